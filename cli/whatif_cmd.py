"""`verlj whatif RUN --from-step A [--to-step B] -o NEW key=value ...`: re-train RUN's steps on its samples under another config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import data_stdout, guarded, log_to_stderr_only_on_rank0, quiet_libraries


def whatif(
    run: Annotated[Path, typer.Argument(help="Run directory whose journaled samples the what-if trains on.")],
    from_step: Annotated[int, typer.Option("--from-step", help="A: start from RUN's state after this step.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="NEW: the what-if's run directory (new or empty).")],
    to_step: Annotated[Optional[int], typer.Option("--to-step", help="B: the last step to train (default: RUN's last).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(help="key=value: optimizer, algorithm and reward keys only.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log the replay to step A (on stderr).")] = False,
) -> None:
    """Train steps A+1..B again on RUN's journaled samples (its prompts, responses and generation
    log-probs, in order; scored again with the reward function) under the overrides, in a new run
    NEW that is marked counterfactual. Generates nothing. Keys that would need new samples are
    refused. `verlj train -o NEW --resume` continues a what-if that stopped."""
    quiet_libraries()
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()
    log_to_stderr_only_on_rank0()
    out = data_stdout()
    from verlj.engine.post_mortem.counterfactual import whatif as run_whatif

    first, last = guarded(lambda: run_whatif(run, from_step, to_step, output, list(overrides or []), quiet=not verbose))
    out(f"Done: what-if {output} of {run}, steps {first}–{last} re-trained on its samples (counterfactual)")


def register(app: typer.Typer) -> None:
    app.command("whatif")(whatif)
