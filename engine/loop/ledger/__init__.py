"""The run ledger: the one package that reads and writes a run's history in the journal's metadata.

    RUN/journal  meta        identity: config, config_hash, seed, versions, topology, created,     ledger.identity
                             git_commit, run_dir, reward_model digest; a fork's parent (its journal    (identity.py)
                             starts after the parent's step: journal.writer.start_after), a what-if's
                             source; config_history (changes from a step on), topology_history
                             (world size / ZeRO stage / TP size changes from a step on, with the
                             rebased fingerprint)
                 meta        lineage (start, fork, what-if, resume; what each ran on)              ledger.lineage (lineage.py)
                 meta        quarantined snapshots, missing snapshots (indexed, gone from disk:    ledger.snapshots
                             unindexed by a resume)                                                (snapshots.py)
                 snapshots   the snapshot index: step -> path, fingerprint, manifest digest, time
                 meta        retention: pruned_through (set by the journal's prune), archive (the  ledger.retention
                             index of RUN/rollouts/*.parquet, loop.archive)                        (retention.py)
                 pending     the episodes and agent calls in flight between two commits            ledger.in_flight (in_flight.py)
                 summary     fingerprints by step (the `state` event of each step)                 Ledger.fingerprints
    RUN/train_metadata.json  a human-readable mirror of the above (the journal is the truth)       Ledger.write_train_metadata
    RUN/writer/              the writer's claim on the run (journal.claim): one writer per run, fenced

This module holds the run directory's journal (opening it in its layout, claiming the run, what
state a run directory is in) and :class:`Ledger`, a run's history over an open journal, whose parts
are the modules beside it, one concern each. Everything else asks the ledger; no other module names a
meta key. No torch here: post-mortem commands read the ledger without loading a deep-learning stack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from verlj.journal import Claim, Journal, JournalError, open_journal_reader, segments
from verlj.journal.claim import being_written, live_holder
from verlj.journal.durable import replace_durably

from ...config import stored_config
from ...errors import RunError
from ...schema.events import ControlKind
from ...state.topology import Topology
from ..records import History, TrainMetadata, config_in_force, now_iso
from .identity import CONFIG, GIT_COMMIT, HISTORY, PARENT, RunIdentity, config_changes
from .in_flight import InFlight
from .lineage import Lineage
from .retention import RetentionIndex
from .snapshots import SnapshotIndex

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
        return _open_writer(run_dir, jc.local_dir, jc.ship_max_lag_steps, claim, str(jc.retain_samples) != "all",
                            jc.segment_fanout, jc.compression_level)
    except BaseException:
        claim.release()
        raise


def _open_writer(run_dir: Path, local_dir: str | None, max_lag: int, claim: Claim, retention: bool,
                 fanout: int, compression_level: int) -> tuple[Journal, list[str]]:
    jd = journal_dir(run_dir)
    if local_dir is None:
        if segments.is_shipped(jd) and not (jd / "data.mdb").is_file():
            raise RunError(f"{run_dir} ships its journal from a node-local directory; resume with "
                           "journal.local_dir=PATH (an empty directory is rebuilt from RUN/journal/segments)")
        warning = segments.lmdb_location_warning(jd.parent if not jd.exists() else jd)
        return Journal.open_writer(jd, claim=claim, compression_level=compression_level), [warning] if warning else []
    if (jd / "data.mdb").is_file():
        raise RunError(f"{run_dir} keeps its LMDB journal in {jd}; journal.local_dir applies to new runs "
                       "(set it to null to resume this one)")
    try:
        return segments.open_writer(Path(local_dir).expanduser(), jd, max_lag, claim, retention, fanout, compression_level)
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
    if CONFIG not in meta:
        return None
    return config_in_force(stored_config(meta[CONFIG]), config_changes(meta.get(HISTORY)), last or 0)


def stage_local_journal(run_dir: Path, local_dir: str) -> bool:
    """A resume that will rebuild its local journal at `local_dir` from the segments: rebuild it once,
    before the resume reads the run (segments.stage_for_writer). Not while a live writer holds the
    run (that start is refused, and leaves nothing behind)."""
    if writer_refusal(run_dir) is not None:
        return False
    return segments.stage_for_writer(journal_dir(run_dir), Path(local_dir).expanduser())


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


def git_commit() -> str | None:
    """The commit of the verlj source that runs (not of whatever directory the user stands in)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def run_state(run_dir: Path) -> str:
    """'none' (no journal), 'empty' (a journal that never committed a step nor a snapshot: a run that
    died before step 1, which a new start may replace), 'lost' (no journal, but what a past run leaves:
    lost_journal), or 'run'."""
    if not journal_exists(run_dir):
        if lost_journal(run_dir) is not None:
            return "lost"
        return "empty" if _started(run_dir) else "none"
    with open_journal_reader(journal_dir(run_dir)) as journal:
        # a journal that holds a step is a run, whatever else it lacks: nothing discards it
        if journal.last_step() == journal.base_step() and not journal.meta.snapshots() and journal.meta.get(PARENT) is None:
            return "empty"
    return "run"


def _started(run_dir: Path) -> bool:
    """A claim, or a pointer to a local journal that was never created: a start killed at its first breath."""
    return segments.read_pointer(journal_dir(run_dir)) is not None or writer_dir(run_dir).is_dir()


def run_holding(path: Path) -> Path | None:
    """The run directory `path` is, or lies in (links followed): a directory with a journal, a writer's claim or what
    a past run leaves (run_state other than 'none'); None when it is in none. What verlj writes for a user (an export)
    never goes there, where it could replace a run's own file or be taken for one."""
    at = Path(path).resolve()
    for d in (at, *at.parents):
        if d.is_dir() and (journal_exists(d) or _started(d) or lost_journal(d) is not None):  # run_state's, without opening it
            return d
    return None


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
        return journal.meta.get(CONFIG) is not None


class Ledger:
    """A run's history, over an open journal (reader or writer): its parts, one object each, and what a
    resume or a replay needs of them at once (:meth:`history`)::

        ledger.identity   the run's identity, its parent, its config and topology history (RunIdentity)
        ledger.lineage    its start, fork or what-if, each resume since, and what each ran on (Lineage)
        ledger.snapshots  the snapshot index, the quarantined snapshots, those gone missing (SnapshotIndex)
        ledger.retention  the last step whose samples were pruned, the rollout archive's index (RetentionIndex)
        ledger.in_flight  the episodes, agent calls and partial generations in flight between two commits (InFlight)
    """

    def __init__(self, journal: Journal):
        self.journal = journal
        self.identity = RunIdentity(journal)
        self.lineage = Lineage(journal, self.identity)
        self.snapshots = SnapshotIndex(journal)
        self.retention = RetentionIndex(journal)
        self.in_flight = InFlight(journal)

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

    def start(self, identity: dict, parent: dict | None = None, base_step: int = 0, chain_base: str | None = None,
              counterfactual: dict | None = None) -> None:
        """Record a new run's identity: a fresh start, or a fork of `parent` at `base_step`, whose journal
        continues the parent's hash chain (`chain_base`: its chain hash after that step). A what-if
        (loop.whatif) is such a fork whose identity says it is `counterfactual`: {run, from_step,
        to_step, overrides, changed}; its steps are trained on that run's samples."""
        kind = ControlKind.WHATIF if counterfactual else ControlKind.FORK if parent else ControlKind.START
        self.identity.record_start({**identity, **self.lineage.started(kind, base_step)}, parent, base_step, chain_base, counterfactual)

    def base_step(self) -> int:
        return self.journal.base_step()

    def last_step(self) -> int:
        return self.journal.last_step()

    # ------------------------------------------------------------------ what was in force, all of it at once

    def history(self) -> History:
        """What a resume or replay needs of the run's history, in one record (see History)."""
        first = self.identity.first_config()
        return History(base_step=self.base_step(), last_step=self.last_step(), pruned_through=self.retention.pruned_through(),
                       first_config=first, config_changes=self.identity.config_changes(),
                       topology_start=self.identity.topology_start(first), topology_changes=self.identity.topology_changes(),
                       produced_on=self.lineage.produced_on())

    def config_at(self, step: int) -> dict:
        """The config in force for `step` (the run's first config, then each recorded change)."""
        return self.history().config_at(step)

    def configs_in(self, first: int, last: int) -> list[dict]:
        """The configs in force for steps first..last (History.configs_in)."""
        return self.history().configs_in(first, last)

    def topology_at(self, step: int) -> Topology:
        """The topology that ran `step`."""
        return self.history().topology_at(step)

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
        index = self.snapshots.index()
        replace_durably(path, json.dumps(TrainMetadata(
            global_step=step,
            epoch=epoch,
            samples_seen=samples_seen,
            last_save_time=now_iso() if saved else old.last_save_time,
            last_snapshot=index[max(index)].path if index else None,
            git_commit=self.identity.get(GIT_COMMIT),
            config_hash=config_hash,
            resume_from=resume_from if resume_from is not None else old.resume_from,
        ).to_dict(), indent=2).encode())
