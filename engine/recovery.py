"""Recovery and replay: newest valid snapshot, then the journal, step by step, to an exact state.

    verlj train --output-dir RUN --resume          # continue a run after any failure
    verlj replay RUN --to-step 1247 [--export DIR]  # the state after step 1247, checked

Replay feeds each journaled step's inputs (samples, rewards, buffer changes, seeds) to the same
``Trainer.apply`` that live training runs, compares the resulting fingerprint with the journaled
one, and stops at the first mismatch. Only rank 0 reads the journal; records reach the other
ranks over torch.distributed. The journal is streamed: memory does not grow with the steps.
"""

from __future__ import annotations

from pathlib import Path

from verlj.journal import Journal, make_event, verify_journal
from verlj.journal.failpoints import failpoint

from .config import Config, ConfigError
from .errors import ReplayError, SnapshotError
from .manifest import check_snapshot, snapshot_name
from .snapshot import SnapshotManager
from .trainer import StepInputs, Trainer, is_timing




# Keys that may change on resume with --allow-config-change: the trainer reads them every step,
# so replay applies each step under the config in force when it was journaled. Others (models,
# topology, data, seeds, batch geometry) would need different engines: refused even with the flag.
LIVE_CHANGEABLE_PREFIXES = (
    "algorithm.",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.max_response_length",
    "model.actor.clip_ratio",
    "model.actor.entropy_coeff",
    "model.actor.kl_loss_coef",
    "model.actor.use_kl_loss",
    "model.actor.ppo_epochs",
    "model.actor.mini_batch_size",
    "model.actor.optim.lr",
    "model.critic.optim.lr",
    "model.critic.cliprange_value",
)


def check_changeable(keys: list[str]) -> None:
    fixed = [k for k in keys if not k.startswith(LIVE_CHANGEABLE_PREFIXES)]
    if fixed:
        raise ConfigError(
            f"{', '.join(fixed)} cannot change within a run (they shape the engines or the data); "
            "start a new run, or fork one with `verlj replay RUN --to-step N --fork NEW_RUN`"
        )


def journal_fingerprints(journal: Journal, steps: list[int]) -> dict[int, str]:
    out = {}
    for s in steps:
        if journal.read_raw(s) is None:
            continue
        for e in journal.read_step(s)["events"]:
            if e["type"] == "state":
                out[s] = e["fingerprint"]
    return out


def config_at(journal: Journal, step: int) -> dict:
    """The config in force for `step` (the run's first config, then each recorded change)."""
    history = journal.get_meta("config_history") or []
    cfg = journal.get_meta("config")
    for entry in history:
        if entry["from_step"] <= step:
            cfg = entry["config"]
    return cfg


def choose_snapshot(run_dir: Path, journal: Journal, limit: int, reporter, explicit: Path | None = None) -> tuple[int, Path | None]:
    """Rank 0: the newest snapshot <= limit whose manifest verifies and whose step and fingerprint
    agree with the journal. Damaged ones are skipped with a warning. (0, None): the initial state."""
    if explicit is not None:
        res = check_snapshot(explicit)
        if not res.valid:
            raise SnapshotError(f"snapshot {explicit} is damaged: {res.problems[0]}")
        candidates = [(res.step, explicit)]
    else:
        index = journal.snapshots()
        candidates = [(s, run_dir / index[s]["path"]) for s in sorted(index, reverse=True) if s <= limit]
    base = journal.base_step()
    fps = journal_fingerprints(journal, [s for s, _ in candidates])
    index = journal.snapshots()
    for step, path in candidates:
        recorded = index.get(step, {}).get("manifest") if explicit is None else None
        res = check_snapshot(path, expected_manifest=recorded)
        if not res.valid:
            reporter.warn(f"Skipping damaged snapshot {path}: {res.problems[0]}")
            continue
        if res.step != step:
            reporter.warn(f"Skipping snapshot {path}: its meta says step {res.step}, the index says {step}")
            continue
        want = fps.get(step)
        if want is not None and res.meta["fingerprint"] != want:
            reporter.warn(f"Skipping snapshot {path}: its fingerprint does not match the journal's for step {step}")
            continue
        if want is None and step != base:
            reporter.warn(f"Skipping snapshot {path}: step {step} is not in the journal")
            continue
        if step > limit:
            raise SnapshotError(f"snapshot {path} is at step {step}, after the target step {limit}")
        return step, path
    if base > 0:
        raise SnapshotError(f"no valid snapshot at or after this run's base step {base} (a fork); nothing to replay from")
    return 0, None


def restore(run_dir: Path, rt, trainer: Trainer, snaps: SnapshotManager, journal: Journal | None, limit: int, reporter,
            explicit: Path | None = None) -> int:
    """Load the chosen snapshot (or keep the initial state). Collective. Returns its step."""
    choice = None
    if rt.is_main:
        step, path = choose_snapshot(run_dir, journal, limit, reporter, explicit)
        choice = [step, str(path) if path is not None else None]
    step, path = rt.broadcast_obj(choice)
    if path is None:
        reporter.info("No usable snapshot: replaying from the initial state (step 0).")
        return 0
    reporter.info(f"Resuming from checkpoint: {path}")
    meta = snaps.load(Path(path))
    reporter.info("Loaded model, optimizer, scheduler and RNG states.")
    reporter.info(
        f"Dataflow anchor restored: dataloader at batch_idx={trainer.sampler.cursor}, "
        f"buffer has {len(trainer.buffer)} pending samples."
    )
    from .workers import fingerprint

    fp, _ = fingerprint(trainer.engines(), rt)
    if fp != meta["fingerprint"]:
        raise ReplayError(f"state loaded from {path} has fingerprint {fp[:16]}…, the snapshot recorded {meta['fingerprint'][:16]}…")
    return step


def replay(rt, trainer: Trainer, journal: Journal | None, start: int, stop: int, base_cfg: Config, reporter,
           check_metrics: bool = True) -> str | None:
    """Apply journaled steps start..stop (inclusive) and check each fingerprint. Collective."""
    from .config import config_from_dict

    fp = None
    records = journal.iter_steps(start, stop) if rt.is_main else None
    history = (journal.get_meta("config_history") or []) if rt.is_main else None
    history = rt.broadcast_obj(history)
    current = base_cfg
    for step in range(start, stop + 1):
        record = next(records) if rt.is_main else None
        if rt.is_main and record["step"] != step:
            raise ReplayError(f"journal step {step} is missing (found {record['step']}); run `verlj verify`")
        record = rt.broadcast_obj(record)
        for entry in history:
            if entry["from_step"] == step:
                current = config_from_dict(entry["config"])
                trainer.set_config(current)
        inputs = StepInputs.from_record(record)
        samples = trainer.take(inputs)
        trainer.advance_sampler(inputs)
        outcome = trainer.apply(step, inputs, samples)
        events = {e["type"]: e for e in record["events"]}
        want = events["state"]["fingerprint"]
        if outcome.fingerprint != want:
            raise ReplayError(
                f"replay diverged at step {step}: fingerprint {outcome.fingerprint[:16]}… but the journal has {want[:16]}…"
            )
        if check_metrics:
            journaled = {k: v for k, v in events["metrics"]["values"].items() if not is_timing(k)}
            mine = {k: v for k, v in outcome.metrics.items() if not is_timing(k)}
            bad = [k for k in journaled if k in mine and not _same_float(journaled[k], mine[k])]
            if bad:
                raise ReplayError(f"replay diverged at step {step}: metric {bad[0]} is {mine[bad[0]]!r}, journaled {journaled[bad[0]]!r}")
        fp = outcome.fingerprint
        failpoint("replay.step")
    return fp


def _same_float(a, b) -> bool:
    return a == b or (a != a and b != b)


def resume_state(run_dir: Path, cfg: Config, rt, trainer: Trainer, journal: Journal | None, snaps: SnapshotManager, reporter,
                 changed: list[str], allow_change: bool) -> tuple[int, list[dict]]:
    """`--resume`: restore the newest valid snapshot, replay the journal to its last step.
    Returns (last committed step, control events for the next record)."""
    from .config import config_from_dict

    problem = None
    if rt.is_main:  # build on an intact journal only: damage anywhere is refused, not carried forward
        report = verify_journal(journal, decode=False)
        if not report.ok:
            problem = f"{report.first_problem}"
    problem = rt.broadcast_obj(problem)
    if problem:
        raise ReplayError(f"the journal is damaged ({problem}); resume refuses to build on it. Run `verlj verify {run_dir}`")
    last = rt.broadcast_obj(journal.last_step() if rt.is_main else None)
    spec = cfg.trainer.resume_from
    explicit, limit = None, last
    if spec not in (None, "auto"):
        if str(spec).isdigit():
            limit = min(int(spec), last)
        else:
            explicit = Path(spec)
            if not explicit.is_absolute() and not explicit.exists():
                explicit = run_dir / spec
    state_changes = [k for k in changed if not k.startswith(("trainer.", "logging."))]
    if state_changes:
        check_changeable(state_changes)
    # replay runs under the configs the journal recorded; the new one takes over afterwards
    stored_last = rt.broadcast_obj(config_at(journal, last) if rt.is_main else None)
    replay_cfg = config_from_dict(stored_last)
    trainer.set_config(replay_cfg)
    step0 = restore(run_dir, rt, trainer, snaps, journal, limit, reporter, explicit)
    if step0 < last:
        first_cfg = config_from_dict(rt.broadcast_obj(config_at(journal, step0 + 1) if rt.is_main else None))
        trainer.set_config(first_cfg)
        replay(rt, trainer, journal, step0 + 1, last, first_cfg, reporter)
        reporter.info(f"Replayed steps {step0 + 1}–{last} from the journal.")
    trainer.set_config(cfg)
    control = [
        make_event(
            "control",
            kind="resume",
            details={
                "from_snapshot": snapshot_name(step0) if step0 else None,
                "snapshot_step": step0,
                "replayed": [step0 + 1, last] if step0 < last else None,
                "config_changes": changed,
                "allow_config_change": allow_change,
                "world_size": rt.world_size,
            },
        )
    ]
    if rt.is_main:
        from .rundir import now_iso

        lineage = journal.get_meta("lineage") or []
        lineage.append({"kind": "resume", "at_step": last, "snapshot_step": step0, "config_changes": changed, "time": now_iso()})
        journal.set_meta("lineage", lineage)
    if changed:
        control.append(make_event("config", config=cfg.to_dict(), hash=cfg.hash(), changed=changed))
        if rt.is_main:
            history = journal.get_meta("config_history") or []
            history.append({"from_step": last + 1, "config": cfg.to_dict()})
            journal.set_meta("config_history", history)
    if last < cfg.trainer.total_steps:
        reporter.info(f"Step {last + 1}: Continuing training...")
    return last, control

