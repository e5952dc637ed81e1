"""One way to read a run back: its journaled steps, in order, read on rank 0 and handed to every rank.

    reader = StepReader(journal, rt)                 # a replay's ranks: rank 0 reads, the others receive
    for record in reader.walk(start, stop): ...      # steps start..stop, each one present, in order
    record = StepReader(journal).read(step)          # this process alone (the post-mortem readers)

Every command that reads a run's steps back reads them here: replay, and through it `train --resume`,
`replay --to-step`, `rerun`, `diff --stages` and the probes, applies what :meth:`StepReader.walk` yields
(recovery.apply_steps: the same ``take`` and ``apply`` live training runs); a what-if reads its parent's
steps with :meth:`StepReader.read` where ``collect`` stands; ``inspect --step`` and ``diff`` read
them without applying, `export --rollouts` and the rollout archive scan them with
:meth:`StepReader.records`, and `export --sft/--dpo` and `verify --against` read them with their chain hashes,
each record checked, through :meth:`StepReader.chained`. Only rank 0 opens the journal; with a runtime, each record reaches the other
ranks through ``Runtime.from_rank0`` (a failure is raised on every rank, so none is left waiting).
Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from verlj.journal import CodecError, Journal, JournalError, SchemaError, StepRecord
from verlj.journal.frames import GENESIS, StepFrame, digest
from verlj.journal.lmdb_env import CHAIN_BASE

from ..errors import ReplayError

if TYPE_CHECKING:
    from ..dist import Runtime


@dataclass(frozen=True)
class Chained:
    """A step as :meth:`StepReader.chained` reads it: its record's chain hash (hex; "" where its frame cannot be
    read), and its record, or the problem that keeps it out (the record is then None)."""

    step: int
    chain: str
    record: StepRecord | None
    problem: str | None = None


class StepReader:
    """A run's journaled steps, as every rank receives them. `journal`: rank 0's (None on the other
    ranks); `rt`: the process group the records are handed to (None: this process alone reads)."""

    def __init__(self, journal: Journal | None, rt: Runtime | None = None):
        assert journal is not None or (rt is not None and not rt.is_main), "rank 0 reads the journal: it needs one"
        self.journal, self.rt = journal, rt

    def _share(self, read: Callable[[], StepRecord], what: str) -> StepRecord:
        """read() on rank 0 and the record on every rank (as plain data, as it crosses ranks)."""
        if self.rt is None:
            return read()
        return StepRecord.from_dict(self.rt.from_rank0(lambda: read().to_dict(), what))

    def _journal(self) -> Journal:
        assert self.journal is not None  # read on rank 0 only
        return self.journal

    def read(self, step: int, what: str | None = None, check: Callable[[StepRecord], None] | None = None) -> StepRecord:
        """Step `step`'s record. `check(record)` runs where it is read (rank 0), before any rank gets it:
        it raises to refuse the record (a what-if's parent step without its samples)."""

        def one() -> StepRecord:
            record = self._journal().read_step(step)
            if check is not None:
                check(record)
            return record

        return self._share(one, what or f"reading step {step} from the journal")

    def records(self, start: int | None = None, stop: int | None = None, payload: bool = True) -> Iterator[StepRecord]:
        """The records the journal holds for start <= step <= stop (None: from its first, to its last),
        pruned ones included, read here without checks (this process alone: the post-mortem readers,
        the archive). payload=False: without the samples, which are then not even decompressed."""
        assert self.rt is None, "records are read by the process that reads them; a replay walks"
        return self._journal().iter_steps(start, stop, payload)

    def walk(self, start: int, stop: int) -> Iterator[StepRecord]:
        """The records of steps start..stop (inclusive), streamed (memory does not grow with the
        steps); a step missing from the journal is refused, as one whose samples retention pruned."""
        records = self._journal().iter_steps(start, stop) if self.rt is None or self.rt.is_main else None
        for step in range(start, stop + 1):

            def next_record(step: int = step) -> StepRecord:
                assert records is not None  # rank 0's
                record = next(records, None)
                if record is None or record.step != step:
                    found = "the journal's end" if record is None else record.step
                    raise ReplayError(f"journal step {step} is missing (found {found}); run `verlj verify`")
                return record

            record = self._share(next_record, f"reading step {step} from the journal")
            if record.pruned:
                raise ReplayError(f"step {step}'s samples were pruned from the journal (journal.retain_samples); it cannot be replayed")
            yield record

    def chained(self, start: int, stop: int) -> Iterator[Chained]:
        """Steps start..stop (inclusive, those the journal holds from its first on), each with its record's chain
        hash, streamed, each record checked on its own as `verlj verify` checks it (its frame, its checksum, its
        link to the record before, its decoding): a damaged one, or a step missing between two held, comes with
        its problem instead of a record, and the walk goes on (this process alone: the exports and their check)."""
        assert self.rt is None, "records are read by the process that reads them; a replay walks"
        journal = self._journal()
        first = journal.first_step()
        if first is None:
            return
        start = max(start, first)
        prev = self._chain_before(start, first)
        expected = start
        for step, raw in journal.iter_raw(start, stop):
            for gap in range(expected, step):
                yield Chained(gap, "", None, "it is missing from the journal")
            expected = step + 1
            try:
                frame = StepFrame.parse(raw)
            except JournalError as e:
                prev = b""
                yield Chained(step, "", None, f"its record has no valid frame ({e})")
                continue
            problem = None
            if not frame.checksum_ok():
                problem = "its stored bytes do not match its checksum"
            elif frame.chain != digest(prev, frame.checksum):
                problem = "its record does not link to the previous record's hash"
            prev = frame.chain
            record = None
            if problem is None:
                try:
                    record = journal.read_step(step)
                except (JournalError, CodecError, SchemaError, KeyError, TypeError, ValueError) as e:
                    problem = f"its record does not decode ({e})"
            yield Chained(step, frame.chain.hex(), record, problem)

    def _chain_before(self, start: int, first: int) -> bytes:
        """The chain hash the record of `start` links to: the record before's, or where the journal's chain starts."""
        journal = self._journal()
        if start > first:
            raw = journal.read_raw(start - 1)
            try:
                return StepFrame.parse(raw).chain if raw is not None else b""
            except JournalError:
                return b""
        base = journal.meta.get(CHAIN_BASE)
        return bytes.fromhex(base) if base else GENESIS
