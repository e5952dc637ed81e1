"""`verlj verify RUN` / `verlj verify RUN/step_00150`: is this run's state intact, and can it resume?

Checks the journal (chain, checksums, step continuity, schemas, LMDB structure) and every
snapshot (manifest; each file's size and BLAKE3 digest; model and optimizer files parse as
weights-only tensors; RNG, metadata and dataflow anchor parse; step and fingerprint agree with the
journal). Reads only; files are hashed in 4 MiB chunks, so memory stays flat whatever their size.
``--deep`` also replays the journal from each valid snapshot and checks every fingerprint.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verlj.journal import JournalError, NotAJournalError, segments, unpackb, verify_journal

from ..errors import ConfigError, HardwareDivergence, RunError
from ..loop import archive
from ..loop.ledger import Ledger, journal_dir, journal_exists, lost_journal
from ..loop.reader import StepReader
from ..loop.records import SnapshotEntry, Unindexed
from ..loop.recovery import damaged_journal_advice
from ..loop.snapshot_store import ADOPT, UNINDEX, Leftover, SnapshotStore
from ..schema.events import StepEvents
from ..schema.record import Record
from ..state.manifest import META, check_snapshot, snapshot_name

PENDING = "buffer/pending"  # the metric of the samples the buffer holds after a step (rl.trainer journals it)


@dataclass
class SnapshotReport(Record):
    name: str
    step: int | None
    indexed: bool
    lines: list[str] = field(default_factory=list)  # "✓ ..." / "✗ ..."
    valid: bool = True
    adopted: bool = False  # not indexed, and the next --resume adopts it (SnapshotStore.plan_leftovers)


@dataclass
class RunReport(Record):
    """What `verify RUN` found; `to_dict()` is its JSON (`--json`): its map, with what the next resume does with
    each leftover in words (Leftover.to_dict) and the verdict (`ok`), neither read back."""

    path: str
    journal_lines: list[str] = field(default_factory=list)
    journal_ok: bool = True
    last_step: int | None = None
    last_good_step: int | None = None
    snapshots: list[SnapshotReport] = field(default_factory=list)
    resume_from: str | None = None
    replay: list[int] | None = None
    advice: str | None = None  # what to do when the journal is damaged (the same words --resume says)
    leftovers: list[str] = field(default_factory=list)  # journal segments and archive files a killed run left; resume removes them
    next_resume: list[Leftover] = field(default_factory=list)  # what the next resume does with each snapshot leftover
    missing: list[dict[str, Any]] = field(default_factory=list)  # indexed snapshots a resume found gone from disk and unindexed (Unindexed maps)
    host_leftovers: list[str] = field(default_factory=list)  # on this node, outside the run (vLLM weights copies)
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # damaged snapshots moved aside on resume (Unindexed maps)
    rotated: list[str] = field(default_factory=list)  # snapshots rotation removed while verify read them
    rotated_by_lost: list[str] = field(default_factory=list)  # removed by a rotation whose commit was in a torn last segment
    deep_lines: list[str] = field(default_factory=list)
    deep_ok: bool = True
    archive_ok: bool = True
    pruned_through: int = 0
    bytes_hashed: int = 0
    torn_segment: str | None = None  # the last shipped segment is torn or damaged: --resume sets it aside
    faults: dict[str, Any] = field(default_factory=dict)  # samples out of the update by a fault, by kind (_verify_faults)

    @property
    def ok(self) -> bool:
        return self.journal_ok and all(s.valid for s in self.snapshots) and self.deep_ok and self.archive_ok and self.advice is None

    def to_dict(self) -> dict:
        """The report as `verify --json` prints it."""
        return {**super().to_dict(), "next_resume": [item.to_dict() for item in self.next_resume], "ok": self.ok}


def verify_snapshot(path: Path, journal_fps: dict[int, str] | None, indexed: bool,
                    recorded_manifest: str | None = None) -> tuple[SnapshotReport, int]:
    res = check_snapshot(path, expected_manifest=recorded_manifest)
    rep = SnapshotReport(path.name, res.step, indexed)
    if not res.valid:
        rep.valid = False
        rep.lines += [f"✗ {p}" for p in res.problems]
        rep.lines.append("→ Checkpoint is damaged; resume will skip it.")
        return rep, res.bytes_hashed
    meta = res.snapshot
    assert meta is not None  # a snapshot whose meta.json does not parse is not valid
    model_tensors = optim_tensors = 0
    refused_here = False
    from ..state.safe_load import tensor_counts

    try:
        engines = meta.engines
        for engine in engines:
            for f in sorted((path / engine).glob("*.pt")):
                n_model, n_optim = tensor_counts(f)
                model_tensors += n_model
                optim_tensors += n_optim
    except Exception as e:  # noqa: BLE001 - a file that does not parse is the finding
        # Its bytes are as written (every checksum above verified): not damage, but a form this
        # interpreter's loader refuses. Nothing skips or quarantines it; it loads where it was written.
        from ..state.safe_load import load_error

        refused_here = True
        rep.lines.append(f"⚠ {f.relative_to(path)}: every checksum verifies, but this Python ({platform.python_version()}) "
                         f"refuses a form in it ({load_error(e)}); written by Python {meta.python or '(not recorded)'}")
    else:
        rep.lines.append(f"✓ Model state dict loaded successfully ({model_tensors} tensors, {', '.join(engines)})")
        rep.lines.append(f"✓ Optimizer state loaded ({optim_tensors} tensors)")
    try:
        streams = set()
        for f in sorted(path.glob("rng_rank*.msgpack")):
            streams |= set(unpackb(f.read_bytes())) - {"version"}
        assert {"torch", "numpy", "python"} <= streams
        rep.lines.append(f"✓ RNG state verified ({', '.join(sorted(streams, key=['torch', 'numpy', 'python', 'cuda'].index))})")
    except Exception:  # noqa: BLE001
        rep.valid = False
        rep.lines.append("✗ RNG state files do not parse")
    rep.lines += [f"✓ {line}" for line in res.ok if line.startswith("Dataflow")]
    rep.lines += [f"✓ {line}" for line in res.ok if line.startswith("All files")]
    if journal_fps is not None:
        want = journal_fps.get(res.step) if res.step is not None else None
        if want is None:
            rep.lines.append(f"✗ step {res.step} is not in the journal")
            rep.valid = False
        elif want != (fingerprint := meta.fingerprint or ""):
            rep.lines.append(f"✗ fingerprint {fingerprint[:16]}… differs from the journal's {want[:16]}… for step {res.step}")
            rep.valid = False
        else:
            rep.lines.append(f"✓ Step {res.step} and fingerprint {want[:16]}… agree with the journal")
    if rep.valid and refused_here:
        rep.lines.append("→ Checkpoint is not damaged and no resume skips or quarantines it, but this Python cannot load it: "
                         "resume under the Python that wrote it.")
    else:
        rep.lines.append("→ Checkpoint is valid for resume." if rep.valid else "→ Checkpoint is damaged; resume will skip it.")
    return rep, res.bytes_hashed


def verify_run(path: Path, deep: bool = False, from_step: int | None = None) -> RunReport:
    """Verify a run directory, or one snapshot directory inside a run."""
    path = Path(path)
    single = (path / META).is_file() or (path / "manifest.json").is_file() or path.name.startswith("step_")
    run_dir = path.parent if single else path
    report = RunReport(str(path))
    fps: dict[int, str] | None = None
    index: dict[int, SnapshotEntry] | None = None  # None: the index cannot be read
    ledger = None
    if journal_exists(run_dir):
        try:
            ledger = Ledger.open_reader(run_dir)
            jr = verify_journal(ledger.journal)
            report.last_step = ledger.last_step()
            report.last_good_step = jr.last_good_step
            try:
                index = ledger.snapshots.index()
                report.quarantined = ledger.snapshots.quarantined()
                report.missing = ledger.snapshots.missing()
            except JournalError:
                index = None
            try:
                fps = ledger.fingerprints()
                base = ledger.identity.base_fingerprint()
                if base is not None:  # a fork's base snapshot: the state it started from
                    fps.setdefault(ledger.base_step(), base)
            except JournalError:
                fps = {}
        except NotAJournalError:
            raise
        except JournalError as e:  # e.g. a truncated data file: nothing in it can be trusted
            jr = None
            report.journal_ok = False
            report.journal_lines.append(f"✗ journal: {e}")
            report.advice = damaged_journal_advice(run_dir, str(e), None)
            fps = {}
        if jr is not None:
            report.journal_ok = jr.ok
            if jr.ok:
                report.journal_lines.append(f"✓ Journal intact: steps {jr.first_step}–{jr.last_step}, {jr.steps} records, hash chain verified")
                report.journal_lines.append("✓ LMDB structure checked (every sub-database walked, entry counts match)")
            else:
                report.journal_lines += [f"✗ journal {p}" for p in jr.problems]
                report.advice = damaged_journal_advice(run_dir, str(jr.first_problem), jr.last_good_step,
                                                       ledger.base_step() if ledger else 0)
        _verify_segments(report, run_dir, ledger)
        if jr is not None and ledger is not None:
            _verify_retention(report, run_dir, ledger, jr)
            if jr.ok:
                _verify_accounting(report, ledger)
                _verify_faults(report, ledger)
    elif not single:
        if (lost := lost_journal(run_dir)) is not None:  # damage, not a wrong path
            raise RunError(lost)
        raise NotAJournalError(f"{path} is not a verlj run (no journal/ inside)")
    else:
        report.journal_lines.append("· no journal next to this snapshot: checked on its own")
    try:
        if single:
            _verify_one(report, path, index, fps)
        else:
            _verify_all(report, run_dir, index, fps, ledger)
    finally:
        if ledger is not None:
            ledger.close()
    from ..rl.vllm_engine import stale_weights_copies

    report.host_leftovers = [f"{path} ({size / 2**20:.1f} MiB)" for path, size in stale_weights_copies()]
    if deep:
        deep_check(report, run_dir, from_step)
    return report


def _verify_segments(report: RunReport, run_dir: Path, ledger: Ledger | None) -> None:
    """A shipped journal (journal.local_dir): every segment's digest, numbering, link and hash chain,
    and how far the live local copy (when this host has it) is ahead of what was shipped."""
    jd = journal_dir(run_dir)
    if not segments.is_shipped(jd):
        return
    found = segments.scan(jd)
    report.leftovers += [f"journal/segments/{name}" for name in found.leftovers]
    report.leftovers += [f"journal/segments/{path.name} (held by a compacted segment)" for path in found.superseded]
    shipped = found.last_step or 0
    if found.problem is None:
        compacted = sum(1 for seg in found.segments if seg.level)
        size = f"{found.bytes / 2**20:.1f} MiB" if found.bytes >= 2**20 else f"{found.bytes / 1024:.0f} KiB"
        held = f"{found.last_seq} shipments, {compacted} of the files compacted; " if compacted else ""
        report.journal_lines.append(f"✓ Journal segments: {len(found.segments)} sealed in {segments.segment_dir(jd)} "
                                    f"({held}{size}), steps through {shipped}; digests, links and hash chain verified")
    elif found.problem_at_end:  # a torn or damaged last segment: what --resume does with it, not a refusal
        live = ledger is not None and ledger.last_step() > shipped and ledger.journal.shipping.problem is None
        if live:
            then = "`verlj train --resume` ships its steps again from the local journal; nothing is lost"
        elif found.lost_steps is None:
            then = "it carried no steps; `verlj train --resume` sets it aside"
        else:
            a, b = found.lost_steps
            lost = f"the steps from {a} on" if b is None else (f"step {a}" if a == b else f"steps {a}–{b}")
            then = f"`verlj train --resume` sets it aside and runs {lost} again (the shipped journal holds steps through {shipped})"
        report.journal_lines.append(f"⚠ journal segments: {found.problem}; {then}")
        report.torn_segment = found.problem
    else:
        report.journal_ok = False
        report.journal_lines.append(f"✗ journal segments: {found.problem}")
        report.advice = damaged_journal_advice(run_dir, found.problem, shipped, ledger.base_step() if ledger else 0)
    if ledger is not None and ledger.journal.shipping.problem is None and ledger.last_step() > shipped:
        report.journal_lines.append(f"· the local journal at {ledger.journal.path} holds steps through {ledger.last_step()} "
                                    f"({ledger.last_step() - shipped} not shipped yet)")


def _verify_retention(report: RunReport, run_dir: Path, ledger: Ledger, jr) -> None:
    """Pruned steps (their cores and chain were checked with the rest) and the rollout archive's files."""
    report.pruned_through = jr.pruned_through
    if jr.pruned:
        report.journal_lines.append(f"✓ Retention: the samples of {jr.pruned} steps through step {jr.pruned_through} were pruned "
                                    "(journal.retain_samples); their records, summaries and place in the hash chain remain and were verified")
    try:
        entries = ledger.retention.archive_entries()
    except JournalError as e:
        report.archive_ok = False
        report.journal_lines.append(f"✗ rollout archive index: {e}")
        return
    report.leftovers += archive.leftovers(run_dir, entries)
    if not entries:
        return
    problems = [p for p in (archive.check_entry(run_dir, e) for e in entries) if p]
    for p in problems:
        report.archive_ok = False
        report.journal_lines.append(f"✗ {p}")
    if not problems:
        rows, size = sum(e.rows for e in entries), sum(e.bytes for e in entries)
        report.journal_lines.append(f"✓ Rollout archive: {len(entries)} files in {archive.ARCHIVE_DIR}/ (steps {entries[0].first}–"
                                    f"{entries[-1].last}, {rows} samples, {size / 2**20:.1f} MiB), digests verified")


def _verify_accounting(report: RunReport, ledger: Ledger) -> None:
    """Async completion order: every group asked arrived at most once, every sample was trained or
    dropped at most once, and what waits is what the buffer held after the last step."""
    from .rollouts import group_accounting

    if ledger.base_step() > 0:
        return
    acc = group_accounting(ledger)
    if acc is None:
        return
    last = ledger.journal.read_summary(ledger.last_step())
    pending = int(StepEvents.of(last).values.get(PENDING, -1)) if last is not None else -1
    faults = [f"{len(ids)} {what} (first: {ids[0]})" for ids, what in (
        (acc.arrived_twice, "groups arrived twice"), (acc.arrived_unasked, "samples arrived unasked"),
        (acc.fate_twice, "samples trained or dropped twice"), (acc.fate_unarrived, "samples trained or dropped without arriving"))
        if ids]
    if acc.waiting != pending:
        faults.append(f"{acc.waiting} samples wait by the journal's account but the buffer held {pending} after step {ledger.last_step()}")
    dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(acc.dropped.items())) or "0"
    counts = (f"{acc.asked} groups asked, {acc.arrived} arrived ({acc.regenerated} asked again after a stop), "
              f"{acc.in_flight} in flight; samples: {acc.trained} trained, {dropped} dropped, {acc.waiting} waiting")
    durable = ledger.in_flight.groups()  # rollout.env: groups of episodes made durable turn by turn (rl.episodes)
    if durable:
        uncommitted = len(set(durable) - acc.all_asked)  # asked in a step that never committed: taken up if asked again
        held = [durable[g] for g in acc.in_flight_groups if g in durable]
        counts += (f"; episodes: {len(held)} of the groups in flight resume from durable turns ({sum(g.turns_durable for g in held)} "
                   f"turns, {sum(g.live for g in held)} episodes still going)"
                   + (f", {uncommitted} more groups from a step that never committed" if uncommitted else ""))
    stopped = ledger.in_flight.partial_groups()  # rollout.partial: generations a push stopped, durable with their tokens (rl.sources.partial_groups)
    if stopped:
        going = [stopped[g] for g in acc.in_flight_groups if g in stopped]
        counts += f"; partial rollouts: {len(going)} of the groups in flight go on from {sum(g.tokens for g in going)} durable tokens"
    if faults:
        report.journal_ok = False
        report.journal_lines.append(f"✗ rollout accounting (async completion order): {counts}; " + "; ".join(faults))
    else:
        report.journal_lines.append(f"✓ Rollout accounting (async completion order): {counts}; each group arrived once, "
                                    "each sample was trained or dropped once at most")


def _verify_faults(report: RunReport, ledger: Ledger) -> None:
    """The samples the run left out of the update by a fault (rl.faults), by kind, from its steps' metrics (payloads not
    read); said only where there are some, with `⚠` where episodes ended unresolved: an external tool call's outcome
    unknown after a crash, which an operator checks in the world by the keys `inspect --step` names (rl.gateway.tools)."""
    from ..rl.faults import ENV_FAULTS, FAULTS, REWARD_FAULTS, UNRESOLVED

    sums = dict.fromkeys((FAULTS, ENV_FAULTS, REWARD_FAULTS, UNRESOLVED), 0)
    unresolved_at: list[int] = []
    for record in StepReader(ledger.journal).records(None, None, payload=False):
        metrics = StepEvents.of(record).metrics
        values = metrics.values if metrics is not None else {}
        for key in sums:
            sums[key] += int(values.get(key, 0))
        if values.get(UNRESOLVED, 0):
            unresolved_at.append(record.step)
    env = sums[ENV_FAULTS] - sums[UNRESOLVED]
    report.faults = {"faults": sums[FAULTS], "env": env, "reward": sums[REWARD_FAULTS], "unresolved": sums[UNRESOLVED],
                     "unresolved_steps": unresolved_at}
    if not sums[FAULTS]:
        return
    line = (f"{sums[FAULTS]} samples ended by a fault, none trained: {env} by their env or agent, "
            f"{sums[REWARD_FAULTS]} by their reward function, {sums[UNRESOLVED]} unresolved")
    if unresolved_at:
        shown = ", ".join(map(str, unresolved_at[:5])) + (", ..." if len(unresolved_at) > 5 else "")
        line += (f" (an external tool call's outcome unknown after a crash: check the world by the keys `verlj inspect RUN "
                 f"--step N` names, steps {shown})")
    report.journal_lines.append(f"{'⚠' if unresolved_at else '·'} {line}")


def _verify_one(report: RunReport, path: Path, index: dict | None, fps) -> None:
    if not path.is_dir():
        raise JournalError(f"snapshot {path} does not exist")
    entry = next((e for e in map(_indexed, (index or {}).values()) if e[0] == path.name), None)
    rep, n = verify_snapshot(path, fps, indexed=entry is not None, recorded_manifest=entry and entry[1])
    report.snapshots.append(rep)
    report.bytes_hashed += n


def _verify_all(report: RunReport, run_dir: Path, index: dict | None, fps, ledger: Ledger | None) -> None:
    """Every indexed snapshot on disk, checked; everything else a resume would sort out, with what the
    next --resume does about it: SnapshotStore.plan_leftovers, the classification the resume carries
    out itself (a snapshot it will adopt is checked like an indexed one, and counts for resume)."""
    store = SnapshotStore(run_dir, ledger)
    refused = None
    if index is None:
        refused = "the journal cannot be read, so --resume refuses the run before touching any snapshot"
    elif report.advice is not None:  # what makes a resume refuse (not, say, a rollout accounting fault)
        refused = "the journal is damaged, so --resume refuses the run before touching any snapshot"
    plan = store.plan_leftovers(index if index is not None else {}, refused)
    for item in plan:
        path = run_dir / item.name
        if item.action == UNINDEX and ledger is not None and _rotated_away(ledger, item.step, path):
            # training goes on while verify reads: rotation unindexed and deleted this snapshot under
            # us. A snapshot leaving the index is not damage.
            report.rotated.append(item.name)
            continue
        if item.action == UNINDEX and report.torn_segment is not None:
            # the commit that rotated it away was in the torn last segment
            report.rotated_by_lost.append(item.name)
            continue
        if item.action == ADOPT:
            rep, n = verify_snapshot(path, fps, indexed=False)
            rep.adopted = True
            report.snapshots.append(rep)
            report.bytes_hashed += n
        report.next_resume.append(item)
    gone = {item.name for item in plan if item.action == UNINDEX}
    for step, entry in sorted((index or {}).items()):
        name, manifest = _indexed(entry)
        if name in gone:
            continue
        rep, n = verify_snapshot(run_dir / name, fps, indexed=True, recorded_manifest=manifest)
        if not rep.valid and ledger is not None and _rotated_away(ledger, step, run_dir / name):
            report.rotated.append(name)  # rotated away between the plan and this check
            continue
        report.snapshots.append(rep)
        report.bytes_hashed += n
    report.snapshots.sort(key=lambda s: (s.step is None, s.step or 0, s.name))
    usable = [s for s in report.snapshots if s.valid and (s.indexed or s.adopted) and s.step is not None
              and (report.last_good_step is None or s.step <= report.last_good_step)]
    if report.journal_ok and report.last_good_step is not None:
        if usable:
            best = max(usable, key=lambda s: s.step or 0)  # each usable one has its step
            report.resume_from = best.name
            if best.step is not None and best.step < report.last_good_step:
                report.replay = [best.step + 1, report.last_good_step]
        elif report.pruned_through > 0:
            report.advice = (f"no valid snapshot is kept, and retention pruned the samples of steps through {report.pruned_through}, "
                             "so they cannot be replayed")
        elif report.last_good_step > 0:
            report.resume_from = "the initial state"
            report.replay = [1, report.last_good_step]


def _indexed(info: SnapshotEntry) -> tuple[str, str | None]:
    """A snapshot index entry: the snapshot's directory name, and its manifest's digest as recorded."""
    return info.path, info.manifest


def _rotated_away(ledger: Ledger, step: int | None, path: Path) -> bool:
    try:
        return step not in ledger.snapshots.index() and not path.exists()
    except JournalError:
        return False


def deep_check(report: RunReport, run_dir: Path, from_step: int | None) -> None:
    """Replay the journal from each valid snapshot (or from --from-step) to the next one, checking fingerprints."""
    from .materialize import exactness_line, materialize

    if from_step is not None and not 0 <= from_step <= (report.last_good_step or 0):
        raise ConfigError(f"--from-step {from_step} is outside the steps this run committed (0–{report.last_good_step or 0}): "
                          "there is nothing to replay from there")
    if report.last_good_step is None or report.last_good_step < 1:
        return
    starts = sorted(s.step for s in report.snapshots if s.valid and s.indexed and s.step is not None)
    if from_step is not None:
        starts = [s for s in starts if s >= from_step] or [from_step]
    targets = [s for s in starts[1:]] + [report.last_good_step]
    done = set()
    for start, stop in zip(starts or [0], targets):
        if stop in done or stop < start:
            continue
        try:
            replayed = materialize(run_dir, stop, max_snapshot=start)
            replayed.run.trainer.close()
            src = snapshot_name(replayed.from_snapshot) if replayed.from_snapshot else "the initial state"
            line = exactness_line(replayed)
            report.deep_lines.append(f"✓ Replayed to step {stop} from {src}: " + ("every fingerprint matches" if line is None else line))
        except HardwareDivergence as e:  # trained on other kernels than this machine's: not damage
            report.deep_lines.append(f"! replay to step {stop}: {e} (not damage: replay on the run's hardware to check it)")
        except Exception as e:  # noqa: BLE001 - the report says what failed
            report.deep_ok = False
            report.deep_lines.append(f"✗ replay to step {stop}: {e}")
        done.add(stop)


def render(report: RunReport) -> str:
    lines = list(report.journal_lines)
    for s in report.snapshots:
        note = "" if s.indexed else " (not in the snapshot index: the next --resume adopts it)" if s.adopted else " (not in the snapshot index)"
        lines.append(f"{s.name}{note}:")
        lines += [f"  {line}" for line in s.lines]
    for name in report.rotated:
        lines.append(f"· {name} was rotated away by the live run while verify read it (not damage)")
    for name in report.rotated_by_lost:
        lines.append(f"· {name} is gone: the rotation that removed it was committed in the torn last segment "
                     "(the next --resume removes it from the index)")
    for q in map(Unindexed.from_dict, report.quarantined):
        lines.append(f"· {q.name} was set aside by a resume and moved to {q.path} ({q.reason}); never used")
    for m in map(Unindexed.from_dict, report.missing):
        lines.append(f"· {m.name} was {m.reason}; a resume removed it from the index")
    for name in report.leftovers:
        lines.append(f"· {name}: left by an interrupted run; never used, and the next --resume removes it")
    for item in report.next_resume:
        lines.append(f"{'⚠' if item.warning else '·'} {item.plan}")
    for name in report.host_leftovers:
        lines.append(f"· {name}: a weights copy a killed vLLM start left on this node; the next `verlj train` removes it")
    lines += report.deep_lines
    if report.advice is not None:
        lines.append(f"Resume is not possible: {report.advice}.")
    elif report.resume_from is not None:
        tail = f", then replay steps {report.replay[0]}–{report.replay[1]} from the journal" if report.replay else ""
        lines.append(f"Resume is possible from {report.resume_from}{tail}.")
    if report.ok:
        lines.append("OK: everything used for resume is intact.")
    elif report.advice is not None and not any("✗" in line for line in lines):  # nothing damaged, but not resumable
        lines.append("NOT RESUMABLE: see the line above.")
    else:
        lines.append("DAMAGED: see the ✗ lines above.")
    return "\n".join(lines)


def to_json(report: RunReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
