"""A run directory and the `verlj train` entry point.

    RUN/
      journal/              the LMDB journal (source of truth)
      config.yaml           the effective config of the latest start
      step_00050/ ...       snapshots (verlj.engine.snapshot)
      latest -> step_00050  the newest published snapshot
      train_metadata.json   a human-readable mirror of the journal's view
      metrics.jsonl         one line per step (logging.jsonl)
"""

from __future__ import annotations

import platform
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verlj.journal import Journal, make_event
from verlj.journal.failpoints import failpoint

from .config import BOOKKEEPING_KEYS, Config, config_from_dict, diff_configs, make_config, to_yaml
from .dist import Runtime, configure_determinism, setup
from .report import Reporter
from .rundir import RunError, git_commit, has_run, journal_dir, now_iso, write_json_atomic  # noqa: F401


def versions() -> dict[str, str]:
    import deepspeed
    import transformers
    from importlib.metadata import version

    return {
        "verlj": version("verlj"),
        "torch": str(torch.__version__),
        "deepspeed": str(deepspeed.__version__),
        "transformers": str(transformers.__version__),
        "python": platform.python_version(),
    }


@dataclass
class StopFlag:
    """SIGINT/SIGTERM: the first finishes the current step, commits and snapshots; a second stops at once."""

    requested: bool = False
    signal_name: str = ""

    def install(self) -> None:
        def handler(signum, _frame):
            if self.requested:
                raise KeyboardInterrupt  # second signal: stop now (the journal holds only whole steps)
            self.requested = True
            self.signal_name = signal.Signals(signum).name

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def resolve_config(run_dir: Path, config_file, overrides, resume: bool, allow_change: bool) -> tuple[Config, list[str], dict | None]:
    """The config to run with. On resume: the run's stored config, then the file and overrides on top;
    only bookkeeping keys may change unless allow_change. Returns (cfg, changed keys, stored dict)."""
    if not resume:
        return make_config(config_file, overrides), [], None
    with Journal.open_reader(journal_dir(run_dir)) as j:
        stored = j.get_meta("config")
    if stored is None:
        raise RunError(f"{run_dir} has a journal but no stored config; it was not written by verlj train")
    cfg = make_config(config_file, overrides, base=stored)
    # keys added to verlj since the run started take their defaults: not a change
    changed = diff_configs(config_from_dict(stored).to_dict(), cfg.to_dict())
    refused = [k for k in changed if k not in BOOKKEEPING_KEYS]
    if refused and not allow_change:
        raise RunError(
            f"the config differs from the run's in {', '.join(refused)}; these change the trained state, "
            "so resume refuses them (pass --allow-config-change to accept and record the change)"
        )
    return cfg, changed, stored


def train(
    output_dir: str | Path,
    config_file: str | Path | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    resume: bool = False,
    allow_config_change: bool = False,
) -> int:
    """`verlj train`: a fresh run, or `--resume` of an existing one. Returns the last committed step."""
    from .recovery import resume_state
    from .trainer import Trainer
    from .snapshot import SnapshotManager

    run_dir = Path(output_dir)
    existing = has_run(run_dir)
    if existing and not resume:
        raise RunError(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --output-dir"
        )
    if resume and not existing:
        if run_dir.exists() and any(p.name != "journal" for p in run_dir.iterdir()):
            raise RunError(f"{run_dir} is not a verlj run (no journal/data.mdb with run metadata); nothing to resume")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--output-dir {run_dir} exists and is not a directory")
    cfg, changed, _stored = resolve_config(run_dir, config_file, overrides, resume and existing, allow_config_change)
    if cfg.trainer.resume_from not in (None, "auto") and not existing:
        raise RunError(f"trainer.resume_from is {cfg.trainer.resume_from!r} but {run_dir} holds no run")

    rt = setup(cfg)
    configure_determinism(cfg)
    journal = None
    stop = StopFlag()
    stop.install()
    trainer = reporter = None

    def open_journal() -> Journal:
        run_dir.mkdir(parents=True, exist_ok=True)
        return Journal.open_writer(journal_dir(run_dir))  # refuses a second writer at once

    try:
        if existing:  # lock an existing run before anything else
            journal = on_rank0(rt, open_journal)
        trainer = Trainer(cfg, rt)  # models, data, rewards: bad input fails here, before a fresh run is written
        if not existing:
            journal = on_rank0(rt, open_journal)
        reporter = Reporter(cfg.logging, run_dir, rt.is_main, cfg.trainer.total_steps)
        snaps = SnapshotManager(run_dir, cfg, rt, trainer, journal, reporter)
        control: list[dict] = []
        if existing:
            last, control = resume_state(run_dir, cfg, rt, trainer, journal, snaps, reporter, changed, allow_config_change)
        else:
            last = 0
            if rt.is_main:
                journal.update_meta(run_meta(cfg, rt, run_dir))
            control.append(make_event("control", kind="start", details={"config_hash": cfg.hash(), "world_size": rt.world_size}))
            reporter.info("Step 0: Starting training...")
        return train_loop(cfg, rt, trainer, snaps, journal, reporter, last, control, run_dir, stop)
    finally:
        if reporter is not None:
            reporter.close()
        if journal is not None:
            journal.close()
        if trainer is not None:
            trainer.close()


def train_loop(cfg: Config, rt: Runtime, trainer, snaps, journal: Journal | None, reporter: Reporter, last: int,
               control: list[dict], run_dir: Path, stop: StopFlag | None = None) -> int:
    """Live steps last+1 .. total_steps: collect, apply, commit, maybe snapshot. Returns the last step."""
    stop = stop or StopFlag()
    if rt.is_main:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    reporter.start(last + 1)
    step = last
    for step in range(last + 1, cfg.trainer.total_steps + 1):
        t_step = time.perf_counter()
        inputs = trainer.collect(step)
        samples = trainer.take(inputs)
        outcome = trainer.apply(step, inputs, samples)
        outcome.metrics.update(inputs.timings)
        outcome.metrics["timing_s/step"] = time.perf_counter() - t_step
        failpoint("step.before_commit")  # the update is done, the journal does not know it yet
        t_commit = time.perf_counter()
        commit(rt, journal, step, control + inputs.events() + outcome.events())
        control = []
        # the commit's own time cannot be in the record it commits: it goes to the logs only
        reporter.step(step, {**outcome.metrics, "timing_s/commit": time.perf_counter() - t_commit})
        stopping = not rt.all_true(not stop.requested)  # every rank stops after the same step
        snaps.after_step(step, outcome, force=stopping or step == cfg.trainer.total_steps)
        if stopping:
            snaps.finish()
            reporter.info(f"Received {stop.signal_name or 'a stop signal'}: step {step} committed and snapshot taken; exiting.")
            break
    snaps.finish()
    if rt.is_main:
        snaps.write_metadata(step, resume_from=None)
    return step


def run_meta(cfg: Config, rt: Runtime, run_dir: Path) -> dict:
    """The journal's run metadata: what produced this run."""
    return {
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "seed": cfg.trainer.seed,
        "versions": versions(),
        "world_size": rt.world_size,
        "tensor_parallel_size": rt.tp_size,
        "num_threads": cfg.trainer.num_threads,
        "created": now_iso(),
        "git_commit": git_commit(),
        "run_dir": str(run_dir.resolve()),
    }


def on_rank0(rt: Runtime, fn):
    """fn() on rank 0 only; its failure is raised on every rank (no rank is left waiting)."""
    result, error = None, ""
    if rt.is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on rank 0, reported on the others
            error = str(e) or type(e).__name__
            if rt.world_size == 1:
                raise
    error = rt.broadcast_obj(error)
    if error:
        if rt.is_main:
            raise RunError(error)
        raise RunError(f"rank 0 failed: {error}")
    return result


def commit(rt: Runtime, journal: Journal | None, step: int, events: list[dict]) -> None:
    """Rank 0 appends the step; every rank learns whether it worked, so all stop together on failure."""
    error = ""
    if rt.is_main:
        try:
            journal.append_step(step, events)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised below
            error = str(e) or type(e).__name__
            if rt.world_size == 1:
                raise
    error = rt.broadcast_obj(error)
    if error:
        raise RunError(f"journal commit of step {step} failed: {error}")
