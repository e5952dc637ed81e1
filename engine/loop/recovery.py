"""Recovery and replay: newest valid snapshot, then the journal, step by step, to an exact state.

    verlj train --output-dir RUN --resume          # continue a run after any failure
    verlj replay RUN --to-step 1247 [--export DIR]  # the state after step 1247, checked

Replay feeds each journaled step's inputs (samples, rewards, buffer changes, seeds) to the same
``Trainer.apply`` that live training runs, compares the resulting fingerprint with the journaled
one, and stops at the first mismatch. Only rank 0 reads the journal; records reach the other
ranks over torch.distributed. The journal is streamed: memory does not grow with the steps.

The plan (which snapshot, what to replay, what to do about damage) is made here for `--resume`,
`replay` and `verify` alike, so they always give the same answer. Importing this module loads no
torch: `verify` and the post-mortem commands use the plan without a deep-learning stack.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verlj.journal import StepRecord, verify_journal
from verlj.journal.failpoints import failpoint

from ..config import config_from_dict
from ..errors import HardwareDivergence, ReplayError, SnapshotError
from ..schema.events import ConfigChange, Control, ControlKind, Stages, StepEvents
from ..state.hardware import cross_hardware, hardware
from ..state.manifest import snapshot_name
from ..state.topology import Topology
from . import archive
from .context import Run
from .ledger import Ledger
from .mirror import Mirror
from .provenance import produced_on
from .reader import StepReader
from .records import Deviation, History, Rebased, Resharded, TopologyChange
from .snapshot_store import SnapshotStore, check_against_journal

# ----------------------------------------------------------------------------- the plan


def damaged_journal_advice(run_dir: Path, problem: str, last_good_step: int | None, base: int = 0) -> str:
    """One answer to 'the journal is damaged: what now?', for resume and verify alike."""
    if last_good_step is not None and last_good_step > base:
        return (f"the journal is damaged ({problem}); resume refuses to build on it. Steps up to {last_good_step} are "
                f"intact: `verlj replay {run_dir} --to-step {last_good_step} --fork NEW_RUN` continues from there in a new run")
    return f"the journal is damaged ({problem}) before any intact step; nothing can be recovered from it: start a new run"


def check_journal(run_dir: Path, ledger: Ledger) -> None:
    """Resume builds on an intact journal only: damage anywhere is refused, with the way forward."""
    report = verify_journal(ledger.journal, decode=False)
    if not report.ok:
        raise ReplayError(damaged_journal_advice(run_dir, str(report.first_problem), report.last_good_step, ledger.base_step()))


def resolve_explicit(run_dir: Path, ledger: Ledger, spec: str) -> tuple[int, Path]:
    """trainer.resume_from=PATH: a snapshot of this run (in its index), or a clear refusal."""
    path = Path(spec)
    if not path.is_absolute() and not path.exists():
        path = Path(run_dir) / spec
    if not path.is_dir():
        raise SnapshotError(f"trainer.resume_from: {spec} is not a snapshot directory")
    if path.resolve().parent != Path(run_dir).resolve():
        raise SnapshotError(
            f"trainer.resume_from: {spec} is not a snapshot of the run in {run_dir}; to start from another run's state, "
            "use `verlj replay OTHER_RUN --to-step N --fork NEW_RUN`"
        )
    for step, entry in ledger.snapshots.index().items():
        if entry.path == path.name:
            return step, path
    raise SnapshotError(f"trainer.resume_from: {spec} is not in this run's snapshot index (rotated away or quarantined)")


def choose_snapshot(run_dir: Path, ledger: Ledger, limit: int, reporter, explicit: tuple[int, Path] | None = None,
                    store: SnapshotStore | None = None, target: int | None = None, mirror: Mirror | None = None) -> tuple[int, Path | None]:
    """Rank 0: the newest snapshot <= limit whose manifest verifies and whose step and fingerprint
    agree with the journal, and from which the journal still holds the samples to replay up to
    `target` (default: limit). A damaged one is skipped with a warning and, when `store` is given (a
    resume, which holds the writer lock), quarantined. `mirror` (a resume on a run that mirrors): its
    memory mirrors are candidates too, before a snapshot of the same step; a damaged one is skipped in one
    line, never quarantined. (0, None): the initial state."""
    index = ledger.snapshots.index()
    mirrored = mirror.candidates(limit) if mirror is not None and explicit is None else []
    if explicit is not None:
        candidates = [explicit]
    else:
        candidates = [(s, run_dir / index[s].path) for s in sorted(index, reverse=True) if s <= limit]
        candidates = sorted([*mirrored, *candidates], key=lambda c: -c[0])  # stable: a mirror before a snapshot of its step
    base = ledger.base_step()
    target = limit if target is None else target
    need = min(target, ledger.retention.pruned_through())  # replay starts after a snapshot at or after this step
    for step, path in candidates:
        if step < need:  # replaying forward from here would need pruned samples
            break
        in_memory = (step, path) in mirrored
        if not path.exists() and explicit is None:  # deleted by hand: a resume has unindexed it already (plan_leftovers)
            if not in_memory:
                reporter.warn(f"Skipping {path.name}: it is in the index but not on disk (deleted by hand?)")
            continue
        _res, problem = check_against_journal(ledger, step, path, index[step].manifest if step in index and not in_memory else None)
        if problem is not None and in_memory:
            reporter.warn(f"Skipping the memory mirror of step {step} ({path}): {problem}")
            continue
        if problem is not None:
            if store is not None and path.exists():
                dest = store.quarantine(step, path, problem)
                reporter.warn(f"Skipping damaged snapshot {path}: {problem} (moved to {dest})")
            else:
                reporter.warn(f"Skipping damaged snapshot {path}: {problem}")
            if explicit is not None:
                raise SnapshotError(f"snapshot {path} is damaged: {problem}")
            continue
        if step > limit:
            raise SnapshotError(f"snapshot {path} is at step {step}, after the target step {limit}")
        return step, path
    if need > base:
        pruned = f"journal.retain_samples pruned the samples of steps through {ledger.retention.pruned_through()}"
        if limit < need:  # asked for an older snapshot than any replay could start from
            kept = [snapshot_name(s) for s in sorted(index) if s >= need]
            raise ReplayError(
                f"no snapshot at or before step {limit} can be used to reach step {target}: {pruned}, so replay must start "
                f"from a snapshot at step {need} or later ({'kept: ' + ', '.join(kept) if kept else 'none is kept'})"
            )
        if need >= limit:  # the target's own samples are gone: only a snapshot of that very step holds it
            raise ReplayError(f"step {target} cannot be brought back: {pruned}, so only a snapshot taken at step {target} "
                              "itself could hold its state, and none is kept")
        raise ReplayError(f"step {target} cannot be brought back: {pruned}, so replay must start from a snapshot at "
                          f"step {need} or later, and no valid one is kept from there to step {limit}")
    if base > 0:
        raise SnapshotError(f"no valid snapshot at or after this run's base step {base} (a fork); nothing to replay from")
    return 0, None


# ----------------------------------------------------------------------------- restore and replay


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` left the run in: the snapshot's step (0: the initial state, nothing loaded), the
    state's fingerprint right after loading it (None then), and how the snapshot was resharded (None: it was
    written under this topology). What a replay from it starts from (:func:`replay`)."""

    step: int
    fingerprint: str | None = None
    resharded: Resharded | None = None
    memory: bool = False  # loaded from the run's memory mirror (loop.mirror), not from a snapshot on disk


def restore(run: Run, limit: int, explicit: tuple[int, Path] | None = None, quarantine: bool = False,
            target: int | None = None, memory: bool = False) -> Restored:
    """Load the chosen snapshot (or keep the initial state). Collective. Returns what it loaded.
    A snapshot of another topology is resharded (the result's `resharded` says so); its fingerprint,
    which hashes the old layout, cannot be compared: the loaded weights are checked instead. `memory`
    (a resume): the run's memory mirror, when it mirrors, is a candidate too."""
    rt, ckpt, reporter = run.rt, run.ckpt, run.reporter
    mirror = ckpt.mirror if memory else None

    def choose() -> list:
        step, path = choose_snapshot(run.run_dir, run.main_ledger(), limit, reporter, explicit, ckpt.store if quarantine else None, target,
                                     mirror)
        return [step, str(path) if path is not None else None]

    step, path = rt.from_rank0(choose, "choosing the snapshot to start from")
    in_memory = mirror is not None and path is not None and Path(path).parent == mirror.root
    if mirror is not None and not in_memory:  # another machine, a mirror skipped as damaged, or a snapshot as new
        reporter.info(f"No memory mirror of this run in {mirror.root} is newer than "
                      f"{Path(path).name if path else 'the initial state'}: starting from it")
    if path is None:
        reporter.info("No usable snapshot: replaying from the initial state (step 0).")
        return Restored(0)
    reporter.info(f"Resuming from checkpoint: {path}" + (f" (the memory mirror of step {step})" if in_memory else ""))
    meta, resharded = ckpt.load(Path(path))
    if resharded is not None:
        how = "its converted form was cached" if resharded.cached else f"converted in {resharded.convert_s:.2f} s"
        reporter.info(f"Resharded {Path(path).name} from {resharded.before} to {resharded.after} ({how}); "
                      "the loaded weights match the converted ones.")
    reporter.info("Loaded model, optimizer, scheduler and RNG states.")
    reporter.info(
        f"Dataflow anchor restored: dataloader at batch_idx={run.trainer.sampler.cursor}, "
        f"buffer has {len(run.trainer.buffer)} pending samples."
    )
    fp, _ = run.trainer.state_fingerprint()
    if resharded is None and fp != meta.fingerprint:
        why = f"state loaded from {path} has fingerprint {fp[:16]}…, the snapshot recorded {str(meta.fingerprint)[:16]}…"
        if in_memory:
            assert mirror is not None  # in_memory: it was the mirror's
            return _from_disk_after(run, mirror, Path(path), why, limit, explicit, quarantine, target)
        raise ReplayError(why)
    return Restored(step, fp, resharded, in_memory)


def _from_disk_after(run: Run, mirror: Mirror, path: Path, why: str, limit: int, explicit, quarantine: bool, target) -> Restored:
    """A memory mirror that loaded as another state than it recorded: removed (the next restart would take it again),
    said, and the newest snapshot on disk loaded over it. Collective."""
    run.reporter.warn(f"{why}: removed it; loading from disk instead")
    if run.rt.is_main:
        mirror.discard(path)
    run.rt.barrier()
    restored = restore(run, limit, explicit, quarantine, target, memory=False)
    if restored.step == 0:  # nothing on disk loaded over the mirror's state: the initial state is gone from this process
        raise ReplayError(f"{why}, and no snapshot on disk is older: start the resume again (a new process builds the initial "
                          "state, and the mirror is removed)")
    return restored


# Replayed under another topology, a step's bits cannot match the journal's (the reductions run in
# another order); its journaled metrics must then agree within this tolerance: |a - b| <= atol + rtol * |b|.
RTOL, ATOL = 1e-3, 1e-5
TOLERANCE = {"rtol": RTOL, "atol": ATOL}  # as the topology control event records it


@dataclass
class ReplayOutcome:
    fingerprint: str | None = None  # of the state after the last replayed step
    exact: bool = True  # every fingerprint matched the journal's (or a rebased one): on the reference line
    tolerant_steps: int = 0  # steps checked within TOLERANCE
    largest: Deviation | None = None  # the largest deviation seen


@dataclass
class Applied:
    """A journaled step as apply_steps applied it: its record, the inputs read from it, the outcome of
    applying them, and the topology the journal says ran it."""

    step: int
    record: StepRecord
    inputs: Any  # rl.trainer.StepInputs
    outcome: Any  # rl.trainer.StepOutcome
    topology: Topology
    boundaries: list[TopologyChange]  # the topology boundaries earlier resumes recorded at this step, in order


def apply_steps(run: Run, history: History, start: int, stop: int, before=None) -> Iterator[Applied]:
    """The journaled steps start..stop (inclusive), each read back (reader.StepReader) and applied to
    the run's trainer under the config in force for it, as live training applied it: the same
    ``take`` and ``apply``. Collective. Yields each step once applied; the caller checks it.
    `before(step, inputs, samples)`: called with each step's inputs just before it is applied."""
    from ..rl.inputs import StepInputs

    rt, trainer = run.rt, run.trainer
    reader = StepReader(run.main_ledger().journal if rt.is_main else None, rt)
    topo = history.topology_at(start)
    trainer.set_config(config_from_dict(history.config_at(start)))
    for record in reader.walk(start, stop):
        step = record.step
        for entry in history.config_changes:
            if entry.from_step == step:
                trainer.set_config(config_from_dict(entry.config))
        boundaries = [change for change in history.topology_changes if change.from_step == step]
        for change in boundaries:
            topo = change.topology
        inputs = StepInputs.from_record(record)
        run.source.replayed(inputs)  # the journaled batches enter the buffer as they did live
        samples = trainer.take(step, inputs)
        trainer.advance_sampler(inputs)
        if before is not None:
            before(step, inputs, samples)
        outcome = trainer.apply(step, inputs, samples)
        outcome.metrics.update(run.source.in_flight())
        yield Applied(step, record, inputs, outcome, topo, boundaries)


def replay(run: Run, history: History, restored: Restored, stop: int, check_metrics: bool = True, observe=None,
           before=None) -> ReplayOutcome:
    """Apply the journaled steps after the one `restored` (restore's) up to `stop` (inclusive), and check each
    one. Collective.

    The rule: a step is checked bit for bit (fingerprint and metrics) while the state is on the
    journal's reference line and the step ran on this topology. A resharded snapshot, or a step
    journaled under another topology, leaves the line: from there each step's journaled metrics are
    checked within TOLERANCE and the largest deviation is kept. A topology boundary recorded by an
    earlier resume (history.topology_changes) brings the replay back on the line when this replay
    reaches it on the same topology with the same state that resume had (its rebased fingerprint).

    `observe(step, record, outcome)` (verlj rerun): called for every step instead of the checks,
    which then raise nothing; it returns False to stop. `before(step, inputs, samples)` (probes):
    called with each step's inputs just before it is applied, the state being the step before's."""
    from ..rl.trainer import is_timing

    out = ReplayOutcome(exact=restored.resharded is None)
    here = run.topology
    prev_fp = restored.fingerprint
    for done in apply_steps(run, history, restored.step + 1, stop, before):
        step, record, outcome = done.step, done.record, done.outcome
        for change in done.boundaries:
            if not out.exact and change.topology == here and change.rebased is not None and prev_fp == change.rebased.fingerprint:
                out.exact = True  # the state that resume trained on from here: back on the line
        out.exact = out.exact and done.topology == here
        mine = {k: v for k, v in outcome.metrics.items() if not is_timing(k)}
        if observe is not None:
            out.fingerprint = prev_fp = outcome.fingerprint
            if not observe(step, record, outcome):
                break
            continue
        if out.exact:
            _check_exact(run, history, step, record, outcome, mine if check_metrics else None)
        else:
            _check_within_tolerance(step, record.metrics, mine, out)
        run.ckpt.replayed(step, record.metrics)
        out.fingerprint = prev_fp = outcome.fingerprint
        failpoint("replay.step")
    return out


def _check_exact(run: Run, history: History, step: int, record: StepRecord, outcome, mine: dict | None) -> None:
    """On the journal's reference line: the replayed step's stages and fingerprint must be the
    journaled ones bit for bit, and so must its metrics `mine` (None: not checked)."""
    from ..rl.trainer import is_timing
    from ..state.stages import first_digest_difference

    journaled_stages = StepEvents.of(record).stages
    if journaled_stages is not None:
        stage = first_digest_difference(journaled_stages.digests, Stages.from_event(outcome.stages).digests)
        if stage is not None:
            raise _diverged(history, step, f"its {stage} differ from the journal's "
                                       f"(`verlj rerun {run.run_dir} --steps {step}:{step}` says more)")
    want = record.state_fingerprint
    if outcome.fingerprint != want:
        raise _diverged(history, step, f"fingerprint {outcome.fingerprint[:16]}… but the journal has {str(want)[:16]}…")
    if mine is not None:
        journaled = record.metrics
        bad = [k for k in journaled if not is_timing(k) and k in mine and not _same_float(journaled[k], mine[k])]
        if bad:
            raise _diverged(history, step, f"metric {bad[0]} is {mine[bad[0]]!r}, journaled {journaled[bad[0]]!r}")


def _diverged(history: History, step: int, what: str) -> ReplayError:
    """A replayed step that differs from the journal: when the step was trained on other hardware than
    this process runs on (state.hardware), the error says that first, on every rank; it is then a HardwareDivergence."""
    cause = cross_hardware(history.versions_at(step), hardware())
    if cause is not None:
        return HardwareDivergence(f"step {step} was {cause} (replay diverged at step {step}: {what})")
    return ReplayError(f"replay diverged at step {step}: {what}")


def _check_within_tolerance(step: int, journaled: dict, mine: dict, out: ReplayOutcome) -> None:
    from ..rl.trainer import is_timing

    rtol, atol = RTOL, ATOL
    for k, want in journaled.items():
        if is_timing(k) or k not in mine:
            continue
        got = mine[k]
        if _same_float(want, got):
            dev = 0.0
        elif want != want or got != got:
            dev = math.inf
        else:
            dev = abs(got - want)
        if out.largest is None or dev > out.largest.deviation:
            out.largest = Deviation(step, k, got, want, dev)
        if dev > atol + rtol * abs(want):
            raise ReplayError(
                f"replay under another topology diverged at step {step}: metric {k} is {got!r}, journaled {want!r} "
                f"(beyond the tolerance {atol} + {rtol} x |journaled|)"
            )
    out.tolerant_steps += 1


def _same_float(a, b) -> bool:
    return a == b or (a != a and b != b)


def materialize_steps(run: Run, to_step: int, explicit: tuple[int, Path] | None = None, max_snapshot: int | None = None,
                      quarantine: bool = False, history: History | None = None, memory: bool = False) -> tuple[Restored, ReplayOutcome]:
    """The state after `to_step`: restore the best snapshot (`memory`: or memory mirror), replay the rest under
    the configs the journal recorded. Collective. Returns (what was restored, what the replay found; its fingerprint
    is None when nothing was replayed). `history`: the run's, when the caller has it already."""
    history = history or run.history()
    run.trainer.set_config(config_from_dict(history.config_at(to_step)))
    limit = to_step if max_snapshot is None else min(to_step, max_snapshot)
    restored = restore(run, limit, explicit, quarantine, target=to_step, memory=memory)
    if restored.step >= to_step:
        return restored, ReplayOutcome(exact=restored.resharded is None)
    out = replay(run, history, restored, to_step)
    if out.tolerant_steps:
        w = out.largest
        assert w is not None  # kept with every step checked within the tolerance
        run.reporter.info(f"Replayed {out.tolerant_steps} step(s) under another topology, checked within rtol {RTOL}, "
                          f"atol {ATOL}: largest deviation {w.deviation:.3g} ({w.metric} at step {w.step}).")
    return restored, out


# ----------------------------------------------------------------------------- --resume


def _topology_boundary(run: Run, history: History, restored: Restored, last: int, out: ReplayOutcome) -> TopologyChange | None:
    """After a resume's restore and replay: the topology boundary at step last + 1, or None when the
    state is still on the journal's reference line on the same topology. The rebased fingerprint is
    the state now, which the steps from last + 1 on build on."""
    here, before = run.topology, history.topology_at(last)
    if out.exact and here == before:
        return None
    fp, _ = run.trainer.state_fingerprint()
    step0 = restored.step
    return TopologyChange(last + 1, here, before, step0, restored.resharded, [step0 + 1, last] if step0 < last else None, TOLERANCE,
                          out.tolerant_steps, out.largest, Rebased(last, fp))


def resume(run: Run, changed: list[str], allow_change: bool) -> tuple[int, list[dict]]:
    """`--resume`: restore the newest valid snapshot, replay the journal to its last step.
    Returns (last committed step, control events for the next record)."""
    rt, cfg, reporter = run.rt, run.cfg, run.reporter
    rt.from_rank0(lambda: check_journal(run.run_dir, run.main_ledger()), "checking the journal")
    if rt.is_main:  # only once the journal is known good: a refused resume touches nothing in the run directory
        for item in run.ckpt.store.recover_leftovers():
            (reporter.warn if item.warning else reporter.info)(item.done)
        for line in archive.clean_leftovers(run.run_dir, run.ledger):
            reporter.info(line)
    history = run.history()
    last = history.last_step
    spec = cfg.trainer.resume_from
    explicit, limit = None, last
    if spec not in (None, "auto"):
        if str(spec).isdigit():
            limit = min(int(spec), last)
        else:
            step, path = rt.from_rank0(lambda: [str(x) for x in resolve_explicit(run.run_dir, run.main_ledger(), spec)],
                                       "finding trainer.resume_from's snapshot")
            explicit = (int(step), Path(path))
    restored, out = materialize_steps(run, last, explicit, max_snapshot=limit, quarantine=True, history=history, memory=True)
    step0 = restored.step
    if step0 < last:
        reporter.info(f"Replayed {f'step {last}' if step0 + 1 == last else f'steps {step0 + 1}–{last}'} from the journal.")
    run.trainer.set_config(cfg)
    from_snapshot = snapshot_name(step0) if step0 else None
    topology = _topology_boundary(run, history, restored, last, out)
    control = [Control(ControlKind.RESUME, {
        "from_snapshot": from_snapshot,
        "snapshot_step": step0,
        "resume_from": spec,
        "replayed": [step0 + 1, last] if step0 < last else None,
        "config_changes": changed,
        "allow_config_change": allow_change,
        "world_size": rt.world_size,
        **({"from_memory": True} if restored.memory else {}),
    }).to_event()]
    if topology is not None:
        assert topology.before is not None  # _topology_boundary's
        control.append(Control(ControlKind.TOPOLOGY, topology.control_details()).to_event())
        reporter.info(f"Step {last + 1}: topology {topology.before} -> {topology.topology}; "
                      "the fingerprints journaled from here on are the new reference.")
    if rt.is_main:
        ledger = run.main_ledger()
        if topology is not None:
            ledger.identity.record_topology_change(topology)
        moved = ledger.lineage.record_resume(last, step0, changed, rt.world_size, produced_on(cfg.to_stored()), resume_from=spec)
        if moved:
            reporter.warn(f"library versions changed since this run last started: {', '.join(moved)} (recorded in its lineage)")
        if changed:
            ledger.identity.record_config_change(last + 1, cfg.to_stored())
        run.ckpt.write_metadata(last, resume_from=from_snapshot or "the initial state")
    if changed:
        control.append(ConfigChange(cfg.to_stored(), cfg.hash(), changed).to_event())
    if last < cfg.trainer.total_steps:
        reporter.info(f"Step {last + 1}: Continuing training...")
    return last, control
