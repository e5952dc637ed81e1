"""One way to read a run back: its journaled steps, in order, read on rank 0 and handed to every rank.

    reader = StepReader(journal, rt)                 # a replay's ranks: rank 0 reads, the others receive
    for record in reader.walk(start, stop): ...      # steps start..stop, each one present, in order
    record = StepReader(journal).read(step)          # this process alone (the post-mortem readers)

Every command that reads a run's steps back reads them here: replay, and through it `train --resume`,
`replay --to-step`, `rerun`, `diff --stages` and the probes, applies what :meth:`StepReader.walk` yields
(recovery.apply_steps: the same ``take`` and ``apply`` live training runs); a what-if reads its parent's
steps with :meth:`StepReader.read` where ``collect`` stands; ``inspect --step`` and ``diff`` read
them without applying, `export --rollouts` and the rollout archive scan them with
:meth:`StepReader.records`. Only rank 0 opens the journal; with a runtime, each record reaches the other
ranks through ``Runtime.from_rank0`` (a failure is raised on every rank, so none is left waiting).
Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from verlj.journal import Journal, StepRecord

from ..errors import ReplayError

if TYPE_CHECKING:
    from ..dist import Runtime


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
