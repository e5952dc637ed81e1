"""`verlj replay RUN --to-step N`: bring back the state after step N, check it, export or fork it.

    verlj replay runs/demo --to-step 120                       # prints the fingerprint
    verlj replay runs/demo --to-step 120 --json                # {"step": 120, "fingerprint": ...}
    verlj replay runs/demo --to-step 120 --export out/hf       # a Hugging Face model directory (LoRA: merged)
    verlj replay runs/demo --to-step 120 --export-adapter out/a  # LoRA: a PEFT adapter directory
    verlj replay runs/demo --to-step 120 --snapshot out/s120   # a verlj snapshot of that state
    verlj replay runs/demo --to-step 120 --fork runs/branch model.actor.optim.lr=5e-4

Reads the run without taking its writer lock, so it works while training goes on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import config_from_dict
from ..dist import configure_determinism, setup
from ..errors import RunError, UsageError
from ..loop.context import Run
from ..loop.ledger import Ledger, has_run, lost_journal, run_state
from ..report import Reporter
from ..rl.lora import check_base
from .outputs import check_output

if TYPE_CHECKING:
    from ..loop.records import Deviation


@dataclass
class Materialized:
    step: int
    fingerprint: str
    from_snapshot: int
    run: Run  # the replayed state's run object (its trainer, checkpointer and runtime)
    exact: bool = True  # the state is on the journal's reference line (its fingerprint is comparable)
    tolerant_steps: int = 0  # steps replayed off that line, checked within recovery.TOLERANCE
    largest: Deviation | None = None  # the largest deviation from the journaled metrics among those


def check_outputs(export: Path | None, snapshot: Path | None, fork: Path | None, adapter: Path | None = None) -> None:
    """Refuse an output directory that would mix verlj's files with someone else's, or lie in a run's, before any work."""
    if fork is not None and run_state(fork) == "run":
        raise RunError(f"{fork} already holds a run; choose another --fork directory")
    for flag, path in (("--export", export), ("--snapshot", snapshot), ("--export-adapter", adapter), ("--fork", fork)):
        if path is None:
            continue
        check_output(flag, path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise RunError(f"{flag} {path} exists and is not empty; choose a new or empty directory")


def replay_config(ledger: Ledger, step: int):
    """The config to re-execute `step` under in this process group: the run's at that step, its TP
    size folded to 1 when the ranks here cannot hold it (e.g. a TP run replayed in one process)."""
    cfg = config_from_dict(ledger.config_at(step))
    if int(os.environ.get("WORLD_SIZE", "1")) % cfg.distributed.tensor_parallel_size:
        return replace(cfg, distributed=replace(cfg.distributed, tensor_parallel_size=1))  # a config of its own
    return cfg


def materialize(run_dir: Path, to_step: int, reporter: Reporter | None = None, quiet: bool = True,
                max_snapshot: int | None = None) -> Materialized:
    """Load the newest valid snapshot <= to_step (and <= max_snapshot) and replay the journal up to
    to_step, checking every fingerprint (collective)."""
    from ..loop.checkpointer import make_run
    from ..loop.recovery import materialize_steps
    from ..rl.trainer import Trainer

    run_dir = Path(run_dir)
    if not has_run(run_dir):
        raise RunError(lost_journal(run_dir) or f"{run_dir} is not a verlj run (no journal/)")
    ledger = Ledger.open_reader(run_dir)
    try:
        last, base = ledger.last_step(), ledger.base_step()
        if not base < to_step <= last and not (to_step == base and base > 0):
            raise UsageError(f"--to-step {to_step} is out of range: {run_dir} has steps {base + 1}–{last}")
        cfg = replay_config(ledger, to_step)
    except BaseException:
        ledger.close()
        raise
    rt = setup(cfg)
    configure_determinism(cfg)
    reporter = reporter or Reporter(cfg.logging, run_dir, enabled=rt.is_main and not quiet, total_steps=to_step, sinks=False)
    run = None
    try:
        run = make_run(run_dir, rt, Trainer(cfg, rt), reporter, ledger if rt.is_main else None)
        # a snapshot holds LoRA adapters only: on another base they would replay, export or re-train another model
        check_base(ledger.identity.loaded().actor_base_digest, run.trainer.actor_base, cfg.model.actor.model_name_or_path)
        restored, out = materialize_steps(run, to_step, max_snapshot=max_snapshot)
        fp = out.fingerprint
        if fp is None:
            fp, _ = run.trainer.state_fingerprint()
    finally:
        ledger.close()
        if run is not None:
            run.closed_ledger()  # the replayed state outlives it (export, --snapshot, --fork)
    return Materialized(to_step, fp, restored.step, run, out.exact, out.tolerant_steps, out.largest)


def export_hf(replayed: Materialized, out_dir: Path) -> None:
    """Write the actor as a Hugging Face model directory (safetensors) with its tokenizer."""
    import deepspeed

    module = replayed.run.trainer.actor.engine.module
    if replayed.run.rt.tp_size > 1 or replayed.run.trainer.actor.lora:
        # AutoTP shards joined (state.reshard), LoRA merged into the base (rl.lora): under the model's own names
        whole = dict(replayed.run.trainer.actor.policy_weights())
        if replayed.run.trainer.actor.lora:
            module = module.get_base_model()
        if replayed.run.rt.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            module.save_pretrained(str(out_dir), state_dict=whole, safe_serialization=True)
            replayed.run.trainer.tokenizer.save_pretrained(str(out_dir))
        replayed.run.rt.barrier()
        return
    params = list(module.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else _null()
    with ctx:
        if replayed.run.rt.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            module.save_pretrained(str(out_dir), safe_serialization=True)
            replayed.run.trainer.tokenizer.save_pretrained(str(out_dir))
    replayed.run.rt.barrier()


def export_adapter(replayed: Materialized, out_dir: Path) -> None:
    """Write the actor's LoRA adapters as a PEFT adapter directory (peft.PeftModel.from_pretrained
    on the base loads it) with the tokenizer."""
    actor = replayed.run.trainer.actor
    if not actor.lora:
        raise UsageError("--export-adapter: this run trains every weight (model.actor.lora_rank is 0); use --export")
    from ..rl.lora import adapter_state

    state = adapter_state(actor.engine.module)
    if replayed.run.rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        actor.engine.module.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        replayed.run.trainer.tokenizer.save_pretrained(str(out_dir))
    replayed.run.rt.barrier()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def write_snapshot(replayed: Materialized, out_dir: Path) -> None:
    """A verlj snapshot of the materialized state at out_dir (with its manifest; not indexed anywhere)."""
    replayed.run.ckpt.write_standalone(replayed.step, replayed.fingerprint, out_dir)


def replay_report(replayed: Materialized) -> str:
    return json.dumps({"step": replayed.step, "fingerprint": replayed.fingerprint, "from_snapshot": replayed.from_snapshot,
                       "exact": replayed.exact, "tolerant_steps": replayed.tolerant_steps, "max_deviation": replayed.largest.to_dict() if replayed.largest else None})


def exactness_line(replayed: Materialized) -> str | None:
    """What a replay that crossed a topology change can promise, in one line (None: bit for bit)."""
    if replayed.exact and not replayed.tolerant_steps:
        return None
    from ..loop.recovery import ATOL, RTOL

    if not replayed.tolerant_steps:
        return ("resharded from a snapshot of another topology (the weights equal the snapshot's); the fingerprint "
                "hashes this topology's layout, so it differs from the journal's")
    w = replayed.largest
    worst = f" (largest deviation {w.deviation:.3g}, {w.metric} at step {w.step})" if w else ""
    then = ("; exact again from the topology boundary on" if replayed.exact else "")
    return (f"{replayed.tolerant_steps} step(s) replayed on another topology than the journal's: bits differ, every journaled "
            f"metric agreed within rtol {RTOL}, atol {ATOL}{worst}{then}")
