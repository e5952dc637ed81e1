"""`verlj replay RUN --to-step N`: bring back the state after step N, check it, export or fork it.

    verlj replay runs/demo --to-step 120                       # prints the fingerprint
    verlj replay runs/demo --to-step 120 --json                # {"step": 120, "fingerprint": ...}
    verlj replay runs/demo --to-step 120 --export out/hf       # a Hugging Face model directory
    verlj replay runs/demo --to-step 120 --snapshot out/s120   # a verlj snapshot of that state
    verlj replay runs/demo --to-step 120 --fork runs/branch model.actor.optim.lr=5e-4

Reads the run without taking its writer lock, so it works while training goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from verlj.journal import Journal, make_event

from .config import config_from_dict, diff_configs, make_config
from .dist import configure_determinism, setup
from .recovery import check_changeable, config_at, replay, restore
from .report import Reporter
from .run import run_meta
from .rundir import RunError, has_run, journal_dir


@dataclass
class Materialized:
    step: int
    fingerprint: str
    from_snapshot: int
    trainer: object
    snaps: object
    rt: object


def materialize(run_dir: Path, to_step: int, reporter: Reporter | None = None, quiet: bool = True,
                max_snapshot: int | None = None) -> Materialized:
    """Load the newest valid snapshot <= to_step (and <= max_snapshot) and replay the journal up to
    to_step, checking every fingerprint (collective)."""
    run_dir = Path(run_dir)
    if not has_run(run_dir):
        raise RunError(f"{run_dir} is not a verlj run (no journal/)")
    journal = Journal.open_reader(journal_dir(run_dir))
    last, base = journal.last_step(), journal.base_step()
    if not base < to_step <= last and not (to_step == base and base > 0):
        journal.close()
        raise RunError(f"--to-step {to_step} is out of range: {run_dir} has steps {base + 1}–{last}")
    meta = journal.meta()
    cfg = config_from_dict(config_at(journal, to_step))
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if meta["world_size"] != world:
        journal.close()
        raise RunError(
            f"{run_dir} was trained on {meta['world_size']} ranks; replay it with the same number "
            f"(torchrun --nproc_per_node {meta['world_size']} -m verlj.cli replay ...)"
        )
    rt = setup(cfg)
    configure_determinism(cfg)
    reporter = reporter or Reporter(cfg.logging, run_dir, enabled=rt.is_main and not quiet, total_steps=to_step)
    from .snapshot import SnapshotManager
    from .trainer import Trainer
    from .workers import fingerprint

    trainer = Trainer(cfg, rt)
    snaps = SnapshotManager(run_dir, cfg, rt, trainer, None, reporter)
    j = journal if rt.is_main else None
    limit = to_step if max_snapshot is None else min(to_step, max_snapshot)
    step0 = restore(run_dir, rt, trainer, snaps, j, limit, reporter)
    if step0 < to_step:
        first = config_from_dict(rt.broadcast_obj(config_at(journal, step0 + 1) if rt.is_main else None))
        trainer.set_config(first)
        fp = replay(rt, trainer, j, step0 + 1, to_step, first, reporter)
    else:
        fp, _ = fingerprint(trainer.engines(), rt)
    journal.close()
    return Materialized(to_step, fp, step0, trainer, snaps, rt)


def export_hf(m: Materialized, out_dir: Path) -> None:
    """Write the actor as a Hugging Face model directory (safetensors) with its tokenizer."""
    import deepspeed

    if m.rt.tp_size > 1:
        raise RunError("--export of a tensor-parallel run is not supported yet; use --snapshot")
    module = m.trainer.actor.engine.module
    params = list(module.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else _null()
    with ctx:
        if m.rt.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            module.save_pretrained(str(out_dir), safe_serialization=True)
            m.trainer.tokenizer.save_pretrained(str(out_dir))
    m.rt.barrier()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def write_snapshot(m: Materialized, out_dir: Path) -> None:
    """A verlj snapshot of the materialized state at out_dir (with its manifest; not indexed anywhere)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RunError(f"--snapshot {out_dir} exists and is not empty")
    m.snaps.write_standalone(m.step, m.fingerprint, out_dir)


def fork(m: Materialized, parent: Path, new_run: Path, overrides: list[str]) -> int:
    """Start a new run from the materialized state; its journal records the parent run and step."""
    from .run import train_loop
    from .snapshot import SnapshotManager

    if has_run(new_run):
        raise RunError(f"{new_run} already holds a run; choose another --fork directory")
    rt, trainer = m.rt, m.trainer
    old = trainer.cfg.to_dict()
    cfg = make_config(None, overrides, base=old)
    changed = diff_configs(old, cfg.to_dict())
    check_changeable([k for k in changed if not k.startswith(("trainer.", "logging."))])
    trainer.set_config(cfg)
    journal = None
    if rt.is_main:
        with Journal.open_reader(journal_dir(parent)) as pj:
            chain = pj.chain_hash(m.step)
        new_run.mkdir(parents=True, exist_ok=True)
        journal = Journal.open_writer(journal_dir(new_run))
        parent = {"run": str(parent.resolve()), "step": m.step, "fingerprint": m.fingerprint}
        journal.update_meta({**run_meta(cfg, rt, new_run), "base_step": m.step, "chain_base": chain, "parent": parent})
    reporter = Reporter(cfg.logging, new_run, rt.is_main, cfg.trainer.total_steps)
    try:
        snaps = SnapshotManager(new_run, cfg, rt, trainer, journal, reporter)
        snaps.save(m.step, m.fingerprint)  # the fork's base: recovery of the new run starts here
        snaps.wait()
        control = [make_event("control", kind="fork", details={"parent": str(parent), "parent_step": m.step, "config_changes": changed})]
        reporter.info(f"Forked {parent} at step {m.step} into {new_run}.")
        return train_loop(cfg, rt, trainer, snaps, journal, reporter, m.step, control, new_run)
    finally:
        reporter.close()
        if journal is not None:
            journal.close()


def replay_report(m: Materialized) -> str:
    return json.dumps({"step": m.step, "fingerprint": m.fingerprint, "from_snapshot": m.from_snapshot})
