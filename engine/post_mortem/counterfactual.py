"""`verlj whatif RUN --from-step A [--to-step B] -o NEW key=value ...`: RUN's steps A+1..B trained
again on its journaled samples under another config, in a new run that says it is counterfactual
(loop.whatif). Everything is checked before anything is replayed or written."""

from __future__ import annotations

from pathlib import Path

from ..errors import RunError
from ..loop.ledger import Ledger, has_run, run_state
from ..loop.whatif import refuse_counterfactual, whatif_config
from .rerun import StepsError


def check_whatif(run_dir: Path, from_step: int, to_step: int | None, new_run: Path, overrides: list[str]) -> int:
    """The what-if's range and config, checked (one sentence, nothing written). Returns the last step B."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not has_run(run_dir):
        raise RunError(f"{run_dir} is not a verlj run (no journal/)")
    if run_state(new_run) == "run" or (new_run.exists() and (not new_run.is_dir() or any(new_run.iterdir()))):
        raise RunError(f"-o {new_run} exists and is not empty; choose a new or empty directory")
    with Ledger.open_reader(run_dir) as ledger:
        refuse_counterfactual(ledger, run_dir, "the base of a what-if", "make a what-if of")
        base, last = ledger.base_step(), ledger.last_step()
        stop = last if to_step is None else to_step
        if not (base < from_step or (from_step == base and base > 0)) or not from_step < stop <= last:
            raise StepsError(f"--from-step {from_step} --to-step {stop} is out of range: {run_dir} has steps {base + 1}–{last} "
                             "(a what-if trains steps A+1..B of them, from the state after A)")
        if ledger.retention.pruned_through() > from_step:
            raise RunError(f"the samples of steps through {ledger.retention.pruned_through()} were pruned from {run_dir}'s journal "
                           f"(journal.retain_samples): a what-if from step {from_step} cannot read them")
        whatif_config(ledger.config_at(from_step), overrides, stop, new_run)
    return stop


def whatif(run_dir: Path, from_step: int, to_step: int | None, new_run: Path, overrides: list[str], quiet: bool = True) -> tuple[int, int]:
    """Check, materialize RUN's state after `from_step`, and train the what-if (collective). Returns
    (its first step, its last committed step)."""
    from ..loop.run import start_whatif
    from .materialize import materialize

    stop = check_whatif(run_dir, from_step, to_step, Path(new_run), list(overrides))
    replayed = materialize(Path(run_dir), from_step, quiet=quiet)
    return from_step + 1, start_whatif(replayed, Path(run_dir), Path(new_run), list(overrides), stop)
