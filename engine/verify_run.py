"""`verlj verify RUN` / `verlj verify RUN/step_00150`: is this run's state intact, and can it resume?

Checks the journal (chain, checksums, step continuity, schemas, LMDB structure) and every
snapshot (manifest; each file's size and BLAKE3 digest; model and optimizer files parse as
weights-only tensors; RNG, metadata and dataflow anchor parse; step and fingerprint agree with the
journal). Reads only; files are hashed in 4 MiB chunks, so memory stays flat whatever their size.
``--deep`` also replays the journal from each valid snapshot and checks every fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verlj.journal import Journal, JournalError, NotAJournalError, unpackb, verify_journal

from .manifest import META, check_snapshot, snapshot_name


@dataclass
class SnapshotReport:
    name: str
    step: int | None
    indexed: bool
    lines: list[str] = field(default_factory=list)  # "✓ ..." / "✗ ..."
    valid: bool = True


@dataclass
class RunReport:
    path: str
    journal_lines: list[str] = field(default_factory=list)
    journal_ok: bool = True
    last_step: int | None = None
    last_good_step: int | None = None
    snapshots: list[SnapshotReport] = field(default_factory=list)
    resume_from: str | None = None
    replay: list[int] | None = None
    deep_lines: list[str] = field(default_factory=list)
    deep_ok: bool = True
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return self.journal_ok and all(s.valid for s in self.snapshots) and self.deep_ok

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _count_tensors(obj) -> int:
    import torch

    count, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            count += 1
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return count


def _weights_only_parse(path: Path) -> tuple[int, int]:
    """Open a DeepSpeed file weights-only (memory-mapped): (model tensors, optimizer tensors)."""
    import torch

    from .snapshot import _safe_globals

    with torch.serialization.safe_globals(_safe_globals()):
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if "optim_states" in path.name:
        return 0, _count_tensors(obj)
    optim = obj.get("optimizer") if isinstance(obj, dict) else None  # ZeRO-0 keeps it beside the weights
    return _count_tensors(obj.get("module") if isinstance(obj, dict) else obj), _count_tensors(optim)


def verify_snapshot(path: Path, journal_fps: dict[int, str] | None, indexed: bool,
                    recorded_manifest: str | None = None) -> tuple[SnapshotReport, int]:
    res = check_snapshot(path, expected_manifest=recorded_manifest)
    rep = SnapshotReport(path.name, res.step, indexed)
    if not res.valid:
        rep.valid = False
        rep.lines += [f"✗ {p}" for p in res.problems]
        rep.lines.append("→ Checkpoint is damaged; resume will skip it.")
        return rep, res.bytes_hashed
    meta = res.meta
    model_tensors = optim_tensors = 0
    try:
        for engine in meta["engines"]:
            for f in sorted((path / engine).glob("*.pt")):
                n_model, n_optim = _weights_only_parse(f)
                model_tensors += n_model
                optim_tensors += n_optim
    except Exception as e:  # noqa: BLE001 - a file that does not parse is the finding
        rep.valid = False
        rep.lines.append(f"✗ {f.relative_to(path)} does not load as weights-only tensors ({str(e).splitlines()[0][:120]})")
    else:
        rep.lines.append(f"✓ Model state dict loaded successfully ({model_tensors} tensors, {', '.join(meta['engines'])})")
        rep.lines.append(f"✓ Optimizer state loaded ({optim_tensors} tensors)")
    try:
        streams = set()
        for f in sorted(path.glob("rng_rank*.msgpack")):
            streams |= set(unpackb(f.read_bytes()))
        assert {"torch", "numpy", "python"} <= streams
        rep.lines.append(f"✓ RNG state verified ({', '.join(sorted(streams, key=['torch', 'numpy', 'python', 'cuda'].index))})")
    except Exception:  # noqa: BLE001
        rep.valid = False
        rep.lines.append("✗ RNG state files do not parse")
    rep.lines += [f"✓ {line}" for line in res.ok if line.startswith("Dataflow")]
    rep.lines += [f"✓ {line}" for line in res.ok if line.startswith("All files")]
    if journal_fps is not None:
        want = journal_fps.get(res.step)
        if want is None:
            rep.lines.append(f"✗ step {res.step} is not in the journal")
            rep.valid = False
        elif want != meta["fingerprint"]:
            rep.lines.append(f"✗ fingerprint {meta['fingerprint'][:16]}… differs from the journal's {want[:16]}… for step {res.step}")
            rep.valid = False
        else:
            rep.lines.append(f"✓ Step {res.step} and fingerprint {want[:16]}… agree with the journal")
    rep.lines.append("→ Checkpoint is valid for resume." if rep.valid else "→ Checkpoint is damaged; resume will skip it.")
    return rep, res.bytes_hashed


def _fingerprints(journal: Journal) -> dict[int, str]:
    out = {}
    for summary in journal.iter_summaries():
        for e in summary["events"]:
            if e["type"] == "state":
                out[summary["step"]] = e["fingerprint"]
    return out


def verify_run(path: Path, deep: bool = False, from_step: int | None = None) -> RunReport:
    """Verify a run directory, or one snapshot directory inside a run."""
    path = Path(path)
    single = (path / META).is_file() or (path / "manifest.json").is_file() or path.name.startswith("step_")
    run_dir = path.parent if single else path
    report = RunReport(str(path))
    jdir = run_dir / "journal"
    fps: dict[int, str] | None = None
    index: dict[int, dict] = {}
    if (jdir / "data.mdb").is_file():
        try:
            with Journal.open_reader(jdir) as j:
                jr = verify_journal(j)
                report.last_step = j.last_step()
                report.last_good_step = jr.last_good_step
                try:
                    index = j.snapshots()
                except JournalError:
                    index = {}
                try:
                    fps = _fingerprints(j)
                except JournalError:
                    fps = {}
        except NotAJournalError:
            raise
        except JournalError as e:  # e.g. a truncated data file: nothing in it can be trusted
            jr = None
            report.journal_ok = False
            report.journal_lines.append(f"✗ journal: {e}")
            fps = {}
        if jr is not None:
            report.journal_ok = jr.ok
            if jr.ok:
                report.journal_lines.append(f"✓ Journal intact: steps {jr.first_step}–{jr.last_step}, {jr.steps} records, hash chain verified")
                report.journal_lines.append("✓ LMDB structure checked (every sub-database walked, entry counts match)")
            else:
                report.journal_lines += [f"✗ journal {p}" for p in jr.problems]
    elif not single:
        raise NotAJournalError(f"{path} is not a verlj run (no journal/ inside)")
    else:
        report.journal_lines.append("· no journal next to this snapshot: checked on its own")
    if single:
        if not path.is_dir():
            raise JournalError(f"snapshot {path} does not exist")
        entry = next((info for info in index.values() if info["path"] == path.name), None)
        rep, n = verify_snapshot(path, fps, indexed=entry is not None, recorded_manifest=entry and entry.get("manifest"))
        report.snapshots.append(rep)
        report.bytes_hashed += n
    else:
        names = {p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_")}
        names |= {info["path"] for info in index.values()}
        indexed = {info["path"] for info in index.values()}
        by_name = {info["path"]: info for info in index.values()}
        for name in sorted(names):
            rep, n = verify_snapshot(run_dir / name, fps, indexed=name in indexed,
                                     recorded_manifest=by_name.get(name, {}).get("manifest"))
            report.snapshots.append(rep)
            report.bytes_hashed += n
        usable = [s for s in report.snapshots if s.valid and s.indexed and s.step is not None
                  and (report.last_good_step is None or s.step <= report.last_good_step)]
        if report.last_good_step is not None:
            if usable:
                best = max(usable, key=lambda s: s.step)
                report.resume_from = best.name
                if best.step < report.last_good_step:
                    report.replay = [best.step + 1, report.last_good_step]
            elif report.last_good_step > 0:
                report.resume_from = "the initial state"
                report.replay = [1, report.last_good_step]
    if deep:
        deep_check(report, run_dir, from_step)
    return report


def deep_check(report: RunReport, run_dir: Path, from_step: int | None) -> None:
    """Replay the journal from each valid snapshot (or from --from-step) to the next one, checking fingerprints."""
    from .materialize import materialize

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
            m = materialize(run_dir, stop, max_snapshot=start)
            m.trainer.close()
            report.deep_lines.append(f"✓ Replayed to step {stop} from {snapshot_name(m.from_snapshot) if m.from_snapshot else 'the initial state'}: every fingerprint matches")
        except Exception as e:  # noqa: BLE001 - the report says what failed
            report.deep_ok = False
            report.deep_lines.append(f"✗ replay to step {stop}: {e}")
        done.add(stop)


def render(report: RunReport) -> str:
    lines = list(report.journal_lines)
    for s in report.snapshots:
        lines.append(f"{s.name}{'' if s.indexed else ' (not in the snapshot index)'}:")
        lines += [f"  {line}" for line in s.lines]
    lines += report.deep_lines
    if report.resume_from is not None:
        tail = f", then replay steps {report.replay[0]}–{report.replay[1]} from the journal" if report.replay else ""
        lines.append(f"Resume is possible from {report.resume_from}{tail}.")
    elif not report.journal_ok and report.last_good_step is None:
        lines.append("Resume is not possible: the journal is damaged.")
    lines.append("OK: everything used for resume is intact." if report.ok else "DAMAGED: see the ✗ lines above.")
    return "\n".join(lines)


def to_json(report: RunReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
