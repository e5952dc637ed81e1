"""The run ledger: the one module that reads and writes a run's history in the journal's metadata.

    RUN/journal  meta        identity: config, config_hash, seed, versions, topology, created,
                             git_commit, run_dir, reward_model digest; a fork's parent (its journal
                             starts after the parent's step: journal.writer.start_after)
                 meta        history: config_history (changes from a step on), topology_history
                             (world size / ZeRO stage / TP size changes from a step on, with the
                             rebased fingerprint), lineage (start, resume, fork), quarantined snapshots,
                             missing snapshots (indexed, gone from disk: unindexed by a resume)
                 meta        retention: pruned_through (set by the journal's prune), archive (the
                             index of RUN/rollouts/*.parquet, loop.archive)
                 snapshots   the snapshot index: step -> path, fingerprint, manifest digest, time
                 summary     fingerprints by step (the `state` event of each step)
    RUN/train_metadata.json  a human-readable mirror of the above (the journal is the truth)
    RUN/writer/              the writer's claim on the run (journal.claim): one writer per run, fenced

Everything else asks the ledger; no other module names a meta key. No torch here: post-mortem
commands read the ledger without loading a deep-learning stack.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

from verlj.journal import Claim, Journal, JournalError, open_journal_reader, segments
from verlj.journal.claim import being_written, live_holder

from ..config import stored_config
from ..errors import RunError
from ..schema.agent_calls import AgentCalls, Call
from ..schema.events import ControlKind
from ..schema.sample import GroupInFlight
from .records import (
    ArchiveEntry,
    ConfigEntry,
    Counterfactual,
    History,
    LineageEntry,
    Loaded,
    ParentRun,
    SnapshotEntry,
    TopologyChange,
    TrainMetadata,
    config_in_force,
    versions_in_force_at,
)

# meta keys, named here only
_CONFIG, _HISTORY, _LINEAGE, _QUARANTINE = "config", "config_history", "lineage", "quarantined"
_MISSING = "missing_snapshots"
_PARENT = "parent"
_ARCHIVE = "archive"
_TOPOLOGY = "topology_history"
_COUNTERFACTUAL = "counterfactual"
_VERSIONS, _GIT_COMMIT = "versions", "git_commit"
_WORLD_SIZE, _TP_SIZE = "world_size", "tensor_parallel_size"


WRITER_DIR = "writer"


def journal_dir(run_dir: Path) -> Path:
    """RUN/journal: the LMDB environment itself, or (journal.local_dir) the segments shipped from it."""
    return Path(run_dir) / "journal"


def writer_dir(run_dir: Path) -> Path:
    """RUN/writer: the claims of the run's writers (journal.claim)."""
    return Path(run_dir) / WRITER_DIR


def claim_run(run_dir: Path, jc, say=None) -> Claim:
    """Claim the run for this process, before anything in it is touched: refuses (JournalLockedError,
    naming the live writer's host and pid) while another writer holds it; takes over, saying so
    through `say`, one whose process is gone or whose lease (jc.writer_lease_s) expired."""
    return Claim.acquire(writer_dir(run_dir), jc.writer_lease_s, what=f"run {run_dir}", say=say)


def writer_refusal(run_dir: Path) -> str | None:
    """One sentence naming the run's live writer, or None when no writer holds it (read only)."""
    found = live_holder(writer_dir(run_dir))
    if found is None:
        return None
    holder, here = found
    tail = "" if here else " on another node (or did until that node was lost: a --resume takes over once its claim expires)"
    return f"{being_written(f'run {run_dir}', holder, writer_dir(run_dir))}{tail}; stop that process first (only one writer per run)"


def check_local_dir(run_dir: Path, jc) -> None:
    """journal.local_dir must be a place of its own: not the run directory, nor inside it."""
    if jc.local_dir is None:
        return
    local, run = Path(os.path.realpath(Path(jc.local_dir).expanduser())), Path(os.path.realpath(run_dir))
    if local == run or run in local.parents:
        raise RunError(f"journal.local_dir {jc.local_dir} is inside the run directory {run_dir}; it is meant for a node-local "
                       "disk outside it (the run directory receives the shipped segments)")


def journal_exists(run_dir: Path) -> bool:
    jd = journal_dir(run_dir)
    return (jd / "data.mdb").is_file() or segments.is_shipped(jd)


def open_writer(run_dir: Path, jc, claim: Claim) -> tuple[Journal, list[str]]:
    """The run's journal writer, in the layout the config asks for. Returns (journal, notes to print).

    A run keeps the layout it started with: the LMDB environment in RUN/journal, or on the node-local
    `local_dir` with RUN/journal receiving shipped segments (a resume may name a new `local_dir`: the
    journal is rebuilt there from the segments). `jc`: the config's journal section; `claim`: this
    process's claim on the run (claim_run), which the journal owns from here (checked before every
    write, released when it closes, or here when the journal cannot be opened)."""
    try:
        journal, notes = _open_writer(run_dir, jc.local_dir, jc.ship_max_lag_steps, claim, str(jc.retain_samples) != "all",
                                      jc.segment_fanout)
    except BaseException:
        claim.release()
        raise
    journal.writer.compression_level = jc.compression_level
    return journal, notes


def _open_writer(run_dir: Path, local_dir: str | None, max_lag: int, claim: Claim, retention: bool,
                 fanout: int) -> tuple[Journal, list[str]]:
    jd = journal_dir(run_dir)
    if local_dir is None:
        if segments.is_shipped(jd) and not (jd / "data.mdb").is_file():
            raise RunError(f"{run_dir} ships its journal from a node-local directory; resume with "
                           "journal.local_dir=PATH (an empty directory is rebuilt from RUN/journal/segments)")
        warning = segments.lmdb_location_warning(jd.parent if not jd.exists() else jd)
        return Journal.open_writer(jd, claim=claim), [warning] if warning else []
    if (jd / "data.mdb").is_file():
        raise RunError(f"{run_dir} keeps its LMDB journal in {jd}; journal.local_dir applies to new runs "
                       "(set it to null to resume this one)")
    try:
        return segments.open_writer(Path(local_dir).expanduser(), jd, max_lag, claim, retention, fanout)
    except segments.CopiedJournalError as e:  # a copy (cp -a) of a run: never written into the original's journal
        last = segments.shipped_meta(jd)[1] or 0
        raise RunError(f"{run_dir} is a copy of the run in {e.owner.parent}, whose journal is in journal.local_dir "
                       f"{e.local}; a copy never writes into it (nothing was changed). Resume the copy (through step "
                       f"{last}) with a journal of its own, rebuilt from its segments: "
                       f"`verlj train -o {run_dir} --resume journal.local_dir=NEW_EMPTY_DIR`, or go on from it as a new run: "
                       f"`verlj replay {run_dir} --to-step {last} --fork NEW_RUN journal.local_dir=NEW_LOCAL_DIR`") from None


def shipped_config(run_dir: Path) -> dict | None:
    """The config in force at a shipped journal's last shipped step, from the newest segments alone
    (nothing rebuilt): None when the journal is not shipped or they hold none."""
    jd = journal_dir(run_dir)
    if (jd / "data.mdb").is_file() or not segments.is_shipped(jd):
        return None
    try:
        meta, last = segments.shipped_meta(jd)
    except JournalError:
        return None  # the readers that follow say what is wrong
    if _CONFIG not in meta:
        return None
    return config_in_force(stored_config(meta[_CONFIG]), _config_changes(meta.get(_HISTORY)), last or 0)


def stage_local_journal(run_dir: Path, local_dir: str) -> bool:
    """A resume that will rebuild its local journal at `local_dir` from the segments: rebuild it once,
    before the resume reads the run (segments.stage_for_writer). Not while a live writer holds the
    run (that start is refused, and leaves nothing behind)."""
    if writer_refusal(run_dir) is not None:
        return False
    return segments.stage_for_writer(journal_dir(run_dir), Path(local_dir).expanduser())


def _config_changes(stored: list[dict] | None) -> list[ConfigEntry]:
    return [ConfigEntry(e.from_step, stored_config(e.config)) for e in map(ConfigEntry.from_dict, stored or [])]


def discard_journal(run_dir: Path) -> None:
    """Remove a journal that never committed a step: RUN/journal and, for a shipped one, the LMDB files
    in the local directory its pointer names (on this host; never a directory it does not name, nor the
    local journal of another run directory that still uses it: segments.local_owner)."""
    jd = journal_dir(run_dir)
    pointer = segments.read_pointer(jd)
    local = Path(pointer["path"]) if pointer is not None else None
    ours = pointer is not None and local is not None and pointer.get("host") == socket.gethostname() \
        and segments.local_owner(local, jd) is None
    if jd.is_dir():
        shutil.rmtree(jd)
    if ours and local is not None:
        for name in ("data.mdb", "lock.mdb", "writer.lock"):
            (local / name).unlink(missing_ok=True)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit() -> str | None:
    """The commit of the verlj source that runs (not of whatever directory the user stands in)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_state(run_dir: Path) -> str:
    """'none' (no journal), 'empty' (a journal that never committed a step nor a snapshot: a run that
    died before step 1, which a new start may replace), 'lost' (no journal, but what a past run leaves:
    lost_journal), or 'run'."""
    if not journal_exists(run_dir):
        if lost_journal(run_dir) is not None:
            return "lost"
        # a claim, or a pointer to a local journal that was never created: a start killed at its first breath
        started = segments.read_pointer(journal_dir(run_dir)) is not None or writer_dir(run_dir).is_dir()
        return "empty" if started else "none"
    with open_journal_reader(journal_dir(run_dir)) as journal:
        # a journal that holds a step is a run, whatever else it lacks: nothing discards it
        if journal.last_step() == journal.base_step() and not journal.meta.snapshots() and journal.meta.get(_PARENT) is None:
            return "empty"
    return "run"


def open_run(run_dir: Path) -> Ledger:
    """A run's ledger for reading (post-mortem commands), or one sentence saying why there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} does not exist")
    if not has_run(run_dir):
        raise RunError(lost_journal(run_dir) or f"{run_dir} is not a verlj run (no journal/ with run metadata)")
    return Ledger.open_reader(run_dir)


_SNAPSHOT_DIR = re.compile(r"^step_\d+$")  # a published snapshot's name (state.manifest.snapshot_name)


def lost_journal(run_dir: Path) -> str | None:
    """One sentence when `run_dir` has no journal but shows a past run: snapshots, train_metadata.json,
    metrics.jsonl with a line in it (none of which a start that died before its first step leaves).
    Its history is gone: nothing may take it for a run that never started, nor move a file of it."""
    run_dir = Path(run_dir)
    if journal_exists(run_dir) or not run_dir.is_dir():
        return None
    snaps = sorted(p.name for p in run_dir.iterdir() if _SNAPSHOT_DIR.match(p.name) and p.is_dir())
    quarantined = run_dir / "quarantine"
    held = sum(1 for p in quarantined.iterdir() if _SNAPSHOT_DIR.match(p.name)) if quarantined.is_dir() else 0
    signs = []
    if snaps:
        signs.append(f"snapshot{'s' if len(snaps) > 1 else ''} ({', '.join(snaps)})")
    if held:
        signs.append(f"{held} quarantined snapshot{'s' if held > 1 else ''}")
    meta = run_dir / "train_metadata.json"
    if meta.is_file():
        try:
            step = TrainMetadata.from_dict(json.loads(meta.read_text())).global_step
        except (OSError, ValueError, AttributeError, TypeError):
            step = None
        signs.append("train_metadata.json" + (f" at step {step}" if isinstance(step, int) else ""))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        signs.append("metrics.jsonl")
    if not signs:
        return None
    has = ", ".join(signs[:-1]) + (" and " if len(signs) > 1 else "") + signs[-1]
    jd = journal_dir(run_dir)
    missing = "no journal/" if not jd.exists() else "no journal in journal/ (neither the LMDB journal nor shipped segments)"
    check = f" (`verlj verify {run_dir / snaps[-1]}` still checks that snapshot on its own)" if snaps else ""
    return (f"{run_dir} has {has} but {missing}: its history, which a resume, a replay and a fork read; nothing was changed. "
            f"Restore {jd} from a backup to go on; without it no verlj command can resume, replay or fork this run{check}, "
            "so start a new run in another --output-dir")


def has_run(run_dir: Path) -> bool:
    """A journal with a run's metadata (one without it died before its first write: not a run)."""
    if not journal_exists(run_dir):
        return False
    with open_journal_reader(journal_dir(run_dir)) as journal:
        return journal.meta.get(_CONFIG) is not None


_GROUP_PREFIX = b"episodes/"


def _group_key(group: int) -> bytes:
    return _GROUP_PREFIX + group.to_bytes(8, "big")


_CALL_PREFIX = b"agentcalls/"  # rollout.agent in completion order: one pending entry a call, (group, episode, position) big-endian


def _call_key(group: int, episode: int | None = None, k: int | None = None) -> bytes:
    """A call's key; a group's calls' common prefix (`episode` None)."""
    key = _CALL_PREFIX + group.to_bytes(8, "big")
    return key if episode is None or k is None else key + episode.to_bytes(4, "big") + k.to_bytes(4, "big")


def _agent_calls(by_position: dict[int, dict]) -> str:
    """An episode's durable calls as its agent_calls text: positions 0, 1, ... up to the first missing (a call
    whose entry failed its checksum and those after it are made again); "" for none."""
    calls: list[Call] = []
    while len(calls) in by_position:
        try:
            calls.append(Call.from_dict(by_position[len(calls)]))
        except (KeyError, TypeError, ValueError, AttributeError):
            break
    return AgentCalls(tuple(calls), (), None, 0).to_json() if calls else ""


class Ledger:
    """A run's history, over an open journal (reader or writer)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def fence(self) -> None:
        """Before a write into the run directory: raise claim.FencedError unless this process still
        holds the run's writer claim (a writer that was taken over must touch nothing)."""
        self.journal.store.fence()

    def make_durable(self) -> None:
        """Return once everything recorded so far is in the journal copy a recovery reads (shipped)."""
        self.journal.shipping.make_durable()

    @classmethod
    def open_reader(cls, run_dir: Path) -> Ledger:
        return cls(open_journal_reader(journal_dir(run_dir)))

    def close(self) -> None:
        self.journal.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ identity

    def start(self, identity: dict, parent: dict | None = None, base_step: int = 0, chain_base: str | None = None,
              counterfactual: dict | None = None) -> None:
        """Record a new run's identity: a fresh start, or a fork of `parent` at `base_step`, whose journal
        continues the parent's hash chain (`chain_base`: its chain hash after that step). A what-if
        (loop.whatif) is such a fork whose identity says it is `counterfactual`: {run, from_step,
        to_step, overrides, changed}; its steps are trained on that run's samples."""
        kind = ControlKind.WHATIF if counterfactual else ControlKind.FORK if parent else ControlKind.START
        values = {**identity, _LINEAGE: [LineageEntry(kind, base_step, time=now_iso()).to_dict()]}
        if counterfactual:
            values[_COUNTERFACTUAL] = counterfactual
        if parent is None:
            self.journal.meta.update(values)
        else:
            # None for a fork at its parent's own base step, whose record the parent's journal does not
            # hold (Journal.chain_hash): stored as it is given, as before
            self.journal.writer.start_after(base_step, cast(str, chain_base), {**values, _PARENT: parent})

    def identity(self) -> dict[str, Any]:
        """Everything recorded about the run (config, versions, topology, ...)."""
        return self.journal.meta.all()

    def loaded(self) -> Loaded:
        """What the trainer loaded when the run started (a resume checks it is the same)."""
        return Loaded.from_dict(self.identity())

    def get(self, key: str, default: Any = None) -> Any:
        """One identity fact (e.g. 'world_size', 'reward_model_digest')."""
        return self.journal.meta.get(key, default)

    def parent(self) -> dict | None:
        """The parent as stored (ParentRun's map): what the post-mortem readers show."""
        return self.journal.meta.get(_PARENT)

    def parent_run(self) -> ParentRun | None:
        """A fork's (or a what-if's) parent; None for a run that was not forked."""
        parent = self.parent()
        return None if parent is None else ParentRun.from_dict(parent)

    def base_fingerprint(self) -> str | None:
        """A fork's state at its base step (which its journal does not hold): the parent's after that
        step under the fork's config (a what-if's too; forks made before this was recorded: the
        parent's fingerprint). None for a run that was not forked."""
        parent = self.parent_run()
        if parent is None:
            return None
        return parent.base_fingerprint if parent.base_fingerprint is not None else parent.fingerprint

    def counterfactual(self) -> dict | None:
        """A what-if's Counterfactual, as stored (the map crosses ranks as it is); None for a run
        trained on its own samples."""
        return self.journal.meta.get(_COUNTERFACTUAL)

    def whatif_of(self) -> Counterfactual | None:
        """A what-if's Counterfactual: the run whose samples it trains on; None for a run trained on its own samples."""
        cf = self.counterfactual()
        return None if cf is None else Counterfactual.from_dict(cf)

    def base_step(self) -> int:
        return self.journal.base_step()

    def last_step(self) -> int:
        return self.journal.last_step()

    # ------------------------------------------------------------------ config history

    def first_config(self) -> dict:
        cfg = self.journal.meta.get(_CONFIG)
        if cfg is None:
            raise RunError(f"{self.journal.path.parent} has a journal but no stored config; it was not written by verlj train")
        return stored_config(cfg)

    def config_history(self) -> list[ConfigEntry]:
        """The changes made on resume, in order."""
        return _config_changes(self.journal.meta.get(_HISTORY))

    def config_at(self, step: int) -> dict:
        """The config in force for `step` (the run's first config, then each recorded change)."""
        return self.history().config_at(step)

    def configs_in(self, first: int, last: int) -> list[dict]:
        """The configs in force for steps first..last (History.configs_in)."""
        return self.history().configs_in(first, last)

    def record_config_change(self, from_step: int, config: dict) -> None:
        self.journal.meta.set(_HISTORY, [*(self.journal.meta.get(_HISTORY) or []), ConfigEntry(from_step, config).to_dict()])

    # ------------------------------------------------------------------ topology history

    def topology_history(self) -> list[dict]:
        """The TopologyChange entries as stored (what the post-mortem readers show)."""
        return list(self.journal.meta.get(_TOPOLOGY) or [])

    def topology_changes(self) -> list[TopologyChange]:
        """The resumes that changed the world size, ZeRO stage or TP size, in order."""
        return [TopologyChange.from_dict(e) for e in self.topology_history()]

    def topology_at(self, step: int) -> dict:
        """{world_size, tensor_parallel_size, zero_stage} that ran `step`."""
        return self.history().topology_at(step)

    # ------------------------------------------------------------------ all of it, once

    def history(self) -> History:
        """What a resume or replay needs of the run's history, in one record (see History)."""
        first = self.first_config()
        start = {"world_size": self.get(_WORLD_SIZE, 1), "tensor_parallel_size": self.get(_TP_SIZE, 1),
                 "zero_stage": first.get("distributed", {}).get("zero_stage", 0)}  # read as stored: inspect reads it anywhere
        return History(base_step=self.base_step(), last_step=self.last_step(), pruned_through=self.pruned_through(),
                       first_config=first, config_changes=self.config_history(), topology_start=start,
                       topology_changes=self.topology_changes(), produced_on=self.produced_on())

    def record_topology_change(self, from_step: int, topology: dict, details: dict) -> None:
        """A TopologyChange: `details` is TopologyChange.details() (how the resume got there)."""
        self.journal.meta.set(_TOPOLOGY, [*self.topology_history(), {"from_step": from_step, "topology": topology, **details}])

    # ------------------------------------------------------------------ lineage

    def lineage_entries(self) -> list[LineageEntry]:
        """start / fork / what-if / resume entries, oldest first (runs from before this entry existed
        start with a resume); a fork's names its parent."""
        entries = [LineageEntry.from_dict(e) for e in self.journal.meta.get(_LINEAGE) or []]
        parent = self.parent()
        if parent is not None and not any(e.forked for e in entries):
            entries.insert(0, LineageEntry(ControlKind.FORK, ParentRun.from_dict(parent).step))
        return [dataclasses.replace(e, parent=parent) if e.forked and e.parent is None else e for e in entries]

    def record_resume(self, at_step: int, snapshot_step: int, config_changes: list[str], world_size: int,
                      now: dict[str, str], resume_from: str | None = None) -> list[str]:
        """Record a resume (and the trainer.resume_from it was asked for: one resume's choice, never the
        run's config) with what it runs on, `now` (loop.provenance.produced_on: the library versions, the
        user modules its config imports, the hardware). Returns the versions that changed since the run
        last started, as 'name old → new'."""
        before = self.versions_in_force()
        moved = [f"{k} {before[k]} → {v}" for k, v in now.items() if k in before and before[k] != v]
        entry = LineageEntry(ControlKind.RESUME, at_step, snapshot_step, config_changes, world_size, now_iso(), now,
                             resume_from if resume_from not in (None, "auto") else None, moved or None)
        self.journal.meta.set(_LINEAGE, [*(self.journal.meta.get(_LINEAGE) or []), entry.to_dict()])
        return moved

    def produced_on(self) -> list:
        """[after_step, versions] of the run's start (-1) and of each start or resume since (History.produced_on)."""
        return [[-1, self.get(_VERSIONS) or {}], *([e.at_step, e.versions] for e in self.lineage_entries() if e.versions)]

    def versions_at(self, step: int) -> dict[str, str]:
        """The versions (and hardware) in force when `step` was trained: those of the last start or resume before it."""
        return versions_in_force_at(self.produced_on(), step)

    def versions_in_force(self) -> dict[str, str]:
        """The library versions of the run's latest start or resume (its identity's, before any resume recorded them)."""
        for entry in reversed(self.lineage_entries()):
            if entry.versions:
                return entry.versions
        return self.get(_VERSIONS) or {}

    def resume_steps(self) -> list[int]:
        return [e.at_step for e in self.lineage_entries() if e.kind is ControlKind.RESUME]

    # ------------------------------------------------------------------ snapshot index

    def snapshot_index(self) -> dict[int, SnapshotEntry]:
        """step -> its SnapshotEntry, oldest first."""
        return {step: SnapshotEntry.from_dict(info) for step, info in self.journal.meta.snapshots().items()}

    def index_snapshot(self, step: int, entry: SnapshotEntry) -> None:
        self.journal.meta.add_snapshot(step, entry.to_dict())

    def unindex_snapshot(self, step: int) -> None:
        self.journal.meta.remove_snapshot(step)

    def quarantined(self) -> list[dict]:
        """Snapshots found damaged and moved aside: [{name, step, reason, path, time}]."""
        return self.journal.meta.get(_QUARANTINE) or []

    def record_quarantine(self, entry: dict) -> None:
        self.journal.meta.set(_QUARANTINE, [*self.quarantined(), {**entry, "time": now_iso()}])

    def missing(self) -> list[dict]:
        """Snapshots the index named that were not on disk (deleted by hand?), which a resume removed
        from the index: [{name, step, reason, time}]."""
        return self.journal.meta.get(_MISSING) or []

    def record_missing(self, entry: dict) -> None:
        self.journal.meta.set(_MISSING, [*self.missing(), {**entry, "time": now_iso()}])

    # ------------------------------------------------------------------ retention

    # ------------------------------------------------------------------ episodes in flight (pending)

    def keep_in_flight(self, groups: list[GroupInFlight], settled, calls=(), dropped=()) -> None:
        """Make these groups' episodes durable as they stand (one transaction, replacing each group's
        entry), and forget the groups in `settled` (their samples are in a committed step) with their calls.
        rollout.agent: `calls` are (group, episode, position, the call's dict: schema.agent_calls.Call), each
        added under its own key (a write costs the calls it adds, never the episode's earlier ones);
        `dropped` (group, episode, position) are forgotten (a divergence discarded them)."""
        self.fence()
        values = {_group_key(g.group): g.to_dict() for g in groups}
        values.update({_call_key(int(g), e, k): d for g, e, k, d in calls})
        drop = [_group_key(int(g)) for g in settled] + [_call_key(int(g), e, k) for g, e, k in dropped]
        self.journal.pending.put(values, drop, [_call_key(int(g)) for g in settled])

    def in_flight(self) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable and not yet forgotten, by group id (a resume keeps those
        still asked); an agent group's calls read back in order into its `agent_calls`."""
        out: dict[int, GroupInFlight] = {}
        calls: dict[int, dict[int, dict[int, dict]]] = {}
        for key, value in self.journal.pending.entries().items():
            if key.startswith(_GROUP_PREFIX):
                try:
                    state = GroupInFlight.from_dict(value)
                except (KeyError, TypeError, ValueError):
                    continue  # not ours to read: as if never written, its group is asked again from its start
                out[state.group] = state
            elif key.startswith(_CALL_PREFIX) and len(key) == len(_CALL_PREFIX) + 16:
                at = len(_CALL_PREFIX)
                group, episode, k = int.from_bytes(key[at:at + 8], "big"), int.from_bytes(key[at + 8:at + 12], "big"), int.from_bytes(key[at + 12:], "big")
                calls.setdefault(group, {}).setdefault(episode, {})[k] = value
        return {g: dataclasses.replace(state, agent_calls=[_agent_calls(calls[g].get(e, {})) for e in range(len(state.env_seed))])
                if g in calls else state for g, state in out.items()}

    def pruned_through(self) -> int:
        """The last step whose samples retention removed from the journal (0: none)."""
        return self.journal.retention.pruned_through()

    def archive_entries(self) -> list[ArchiveEntry]:
        """The archived samples of pruned steps, oldest first."""
        return [ArchiveEntry.from_dict(e) for e in self.journal.meta.get(_ARCHIVE) or []]

    def prune(self, through: int, archived: ArchiveEntry | None = None) -> tuple[int, int]:
        """Remove the samples of steps through `through`, indexing their archive file in the same
        transaction. Returns (steps pruned, bytes freed)."""
        meta = {_ARCHIVE: [*(self.journal.meta.get(_ARCHIVE) or []), archived.to_dict()]} if archived else None
        return self.journal.retention.prune(through, meta)

    # ------------------------------------------------------------------ metrics

    def metrics(self, start: int | None = None, stop: int | None = None) -> Iterator[tuple[int, dict[str, float]]]:
        """(step, the metrics journaled for it) for start <= step <= stop, from the summaries (no samples read)."""
        for summary in self.journal.iter_summaries(start, stop):
            yield summary.step, summary.metrics

    # ------------------------------------------------------------------ fingerprints

    def fingerprints(self, start: int | None = None, stop: int | None = None) -> dict[int, str]:
        """step -> the fingerprint journaled after it (from the summaries: no samples decoded)."""
        return {summary.step: summary.state_fingerprint for summary in self.journal.iter_summaries(start, stop)
                if summary.state_fingerprint is not None}

    def fingerprint_at(self, step: int) -> str | None:
        summary = self.journal.read_summary(step)
        return None if summary is None else summary.state_fingerprint

    # ------------------------------------------------------------------ the human-readable mirror

    def write_train_metadata(self, run_dir: Path, *, step: int, epoch: int, samples_seen: int, config_hash: str,
                             resume_from: str | None = None, saved: bool = False) -> None:
        """RUN/train_metadata.json, as the tutorial shows it: a view of the ledger for people."""
        path = Path(run_dir) / "train_metadata.json"
        try:
            old = TrainMetadata.from_dict(json.loads(path.read_text())) if path.is_file() else TrainMetadata()
        except (ValueError, AttributeError, TypeError):
            old = TrainMetadata()
        index = self.snapshot_index()
        write_json_atomic(path, TrainMetadata(
            global_step=step,
            epoch=epoch,
            samples_seen=samples_seen,
            last_save_time=now_iso() if saved else old.last_save_time,
            last_snapshot=index[max(index)].path if index else None,
            git_commit=self.journal.meta.get(_GIT_COMMIT),
            config_hash=config_hash,
            resume_from=resume_from if resume_from is not None else old.resume_from,
        ).to_dict())
