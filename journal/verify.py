"""Walk a journal and report every problem, first one first.

Checks, in one streaming pass (constant memory):

- LMDB structure: every sub-database can be walked end to end by a cursor and
  holds as many entries as its B-tree header says (py-lmdb exposes no mdb_chk;
  a damaged page surfaces here as an LMDB error).
- per step record: frame header, checksum of the stored bytes (core and payload), chain link to
  the previous record, decodability, schema versions, and that the record's own
  step number matches its key; steps are consecutive from ``base_step + 1``. A step whose
  payload is gone is fine only if retention pruned it (meta ``pruned_through``).
- meta and snapshot-index entries: frame header and checksum; the interned core shapes (meta
  ``shapes``) are exactly the ones the records declare, in order (so the chain covers them too).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import lmdb

from . import codec
from .errors import CodecError, JournalError, SchemaError
from .events import summary_types
from .frames import GENESIS, StepFrame, decode_frame, digest, key_step, unframe_plain
from .lmdb_env import BASE_STEP, CHAIN_BASE, SHAPES
from .store import Journal

MAX_PROBLEMS = 100

# problem kinds
BAD_CHECKSUM = "bad_checksum"
BROKEN_CHAIN = "broken_chain"
MISSING_STEP = "missing_step"
UNDECODABLE = "undecodable"
UNKNOWN_SCHEMA = "unknown_schema"
STEP_MISMATCH = "step_mismatch"
LMDB_STRUCTURE = "lmdb_structure"
BAD_META = "bad_meta"
BAD_SNAPSHOT_INDEX = "bad_snapshot_index"
BAD_SUMMARY = "bad_summary"
PAYLOAD_MISSING = "payload_missing"


@dataclass
class Problem:
    kind: str
    step: int | None
    message: str

    def __str__(self) -> str:
        where = f"step {self.step}: " if self.step is not None else ""
        return f"{where}{self.kind}: {self.message}"


@dataclass
class JournalReport:
    """What verify_journal found. Its map (to_dict: `verify --json`) is written here: the journal stands below
    engine/schema and its codec."""

    path: str
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    pruned: int = 0  # steps whose samples retention removed (their cores and chain are checked)
    pruned_through: int = 0
    problems: list[Problem] = field(default_factory=list)
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first_problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    @property
    def last_good_step(self) -> int | None:
        """The last step before the first damaged one: replay can be trusted up to here."""
        bad = [p.step for p in self.problems if p.step is not None]
        if not bad:
            return self.last_step if self.ok else None
        return min(bad) - 1

    def add(self, kind: str, step: int | None, message: str) -> None:
        if len(self.problems) >= MAX_PROBLEMS:
            self.truncated = True
            return
        self.problems.append(Problem(kind, step, message))

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "last_good_step": self.last_good_step}


def verify_journal(journal: Journal, decode: bool = True) -> JournalReport:
    """Walk the whole journal. decode=False checks frames, checksums, the chain, continuity and the
    LMDB structure but skips decoding records (what a resume does before trusting the journal)."""
    report = JournalReport(path=str(journal.path))
    base_step, prev_chain, meta = _chain_start(journal, report)
    expected = base_step + 1
    declared = codec.Shapes()  # built from the records' own declarations only: each may use only what came before it
    try:
        for step, raw in journal.iter_raw():
            _count_step(report, step, expected)
            expected = step + 1
            prev_chain = _check_step(journal, report, step, raw, prev_chain, declared, decode)
    except lmdb.Error as e:
        report.add(LMDB_STRUCTURE, None, f"LMDB error while walking steps: {e}")

    if decode and report.problems == [] and meta.get(SHAPES, []) != [list(e) for e in declared.entries]:
        report.add(BAD_META, None, "the journal's interned shapes (meta 'shapes') differ from the shapes its records declare")
    _check_structure(journal, report)
    return report


def _chain_start(journal: Journal, report: JournalReport) -> tuple[int, bytes, dict]:
    """(base step, chain hash before the first record, meta): meta first, base_step and chain_base
    decide where the chain starts."""
    base_step, prev_chain, meta = 0, GENESIS, {}
    try:
        meta = journal.meta.all()
        base_step = int(meta.get(BASE_STEP, 0))
        report.pruned_through = int(meta.get("pruned_through", 0))
        if CHAIN_BASE in meta:
            prev_chain = bytes.fromhex(meta[CHAIN_BASE])
    except (JournalError, ValueError) as e:
        report.add(BAD_META, None, str(e))
    return base_step, prev_chain, meta


def _count_step(report: JournalReport, step: int, expected: int) -> None:
    report.steps += 1
    if report.first_step is None:
        report.first_step = step
    report.last_step = step
    if step != expected:
        if step > expected:
            missing = f"{expected}" if step == expected + 1 else f"{expected}–{step - 1}"
            report.add(MISSING_STEP, expected, f"step(s) {missing} absent before step {step}")
        else:
            report.add(MISSING_STEP, step, f"step {step} found where step {expected} was expected")


def _check_step(journal: Journal, report: JournalReport, step: int, raw: bytes, prev_chain: bytes,
                declared: codec.Shapes, decode: bool) -> bytes:
    """Check one stored record: frame, checksum, chain link, payload; then its content. Returns the
    chain hash the next record links to."""
    try:
        frame = StepFrame.parse(raw)
    except JournalError as e:
        report.add(UNDECODABLE, step, f"record has no valid frame header ({e})")
        return b""
    if not frame.checksum_ok():
        report.add(BAD_CHECKSUM, step, "stored bytes do not match the record's checksum")
    if frame.chain != digest(prev_chain, frame.checksum):
        report.add(BROKEN_CHAIN, step, "record does not link to the previous record's hash")
    if frame.pruned:
        report.pruned += 1
        if step > report.pruned_through:
            report.add(PAYLOAD_MISSING, step, f"the record's samples are gone, but retention pruned only through step {report.pruned_through}")
    if not decode:
        try:
            journal.read_summary(step)  # its frame checksum, at least
        except (JournalError, CodecError, SchemaError) as e:
            report.add(BAD_SUMMARY, step, str(e))
    else:
        _check_content(journal, report, step, frame, declared)
    return frame.chain


def _check_content(journal: Journal, report: JournalReport, step: int, frame: StepFrame, declared: codec.Shapes) -> None:
    """Decode one record; a v1 record's summary entry must match it."""
    try:
        record = decode_frame(frame, shapes=declared)
    except CodecError as e:
        return report.add(UNDECODABLE, step, str(e))
    except SchemaError as e:
        return report.add(UNKNOWN_SCHEMA, step, str(e))
    except (KeyError, TypeError, ValueError) as e:
        return report.add(UNDECODABLE, step, f"record has an invalid shape: {e}")
    if record.step != step:
        return report.add(STEP_MISMATCH, step, f"record stored at step {step} says it is step {record.step}")
    if frame.version != 1:
        return None  # a v2 record's core is its summary
    try:
        summary = journal.read_summary(step)
    except (JournalError, CodecError, SchemaError) as e:
        return report.add(BAD_SUMMARY, step, str(e))
    want = [e for e in record.events if e["type"] in summary_types()]
    if summary is None or codec.packb(summary.events) != codec.packb(want):
        report.add(BAD_SUMMARY, step, "the step's summary entry is missing or differs from its record")
    return None


def _check_structure(journal: Journal, report: JournalReport) -> None:
    """Every sub-database's cursor walk against its B-tree entry count; meta and snapshot frames."""
    try:
        with journal.store.env().begin(buffers=True) as txn:
            for name, db in journal.store.dbs().items():
                counted = 0
                for key, value in txn.cursor(db):
                    counted += 1
                    if name == "meta":
                        try:
                            unframe_plain(value, f"meta {bytes(key).decode(errors='replace')!r}")
                        except JournalError as e:
                            report.add(BAD_META, None, str(e))
                    elif name == "snapshots":  # summary entries: checked against each record above
                        try:
                            unframe_plain(value, f"snapshot index entry {key_step(key)}")
                        except JournalError as e:
                            report.add(BAD_SNAPSHOT_INDEX, key_step(key), str(e))
                entries = txn.stat(db)["entries"]
                if counted != entries:
                    report.add(LMDB_STRUCTURE, None, f"sub-database {name!r} lists {entries} entries but {counted} are reachable")
    except lmdb.Error as e:
        report.add(LMDB_STRUCTURE, None, f"LMDB error while checking structure: {e}")
