"""The run's durable log: where completion order makes what is in flight durable between two commits (a group of
episodes after each turn, an agent's calls as they are answered, the generations a push stopped), over the run's
ledger (``ledger.in_flight``: the journal's pending store). Rank 0 writes and reads; every rank waits for it
(``Runtime.from_rank0``). The rollout's players are made with it (``rl.sources.players.InFlightLog``), and reach the
journal through it alone: player -> :class:`DurableLog` -> ``Ledger.in_flight`` -> ``journal.pending``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schema.sample import GroupInFlight, GroupProgress
from .records import attempt_at

if TYPE_CHECKING:
    from ..dist import Runtime
    from .ledger import Ledger


class DurableLog:
    """rl.sources.InFlightLog over the run's ledger (rank 0's; None on the other ranks)."""

    def __init__(self, rt: Runtime, ledger: Ledger | None):
        self.rt, self.ledger = rt, ledger

    def _held(self) -> Ledger:
        assert self.ledger is not None, "the ledger is rank 0's"
        return self.ledger

    def keep(self, groups: list[GroupInFlight], settled: list[int], calls: list | None = None, dropped: list | None = None) -> None:
        self.rt.from_rank0(lambda: self._held().in_flight.keep(groups, settled, calls or (), dropped or ()), "making episodes' turns durable")

    def read(self) -> dict[int, GroupInFlight]:
        got = self.rt.from_rank0(lambda: [g.to_dict() for g in self._held().in_flight.groups().values()], "reading the episodes in flight")
        return {g.group: g for g in map(GroupInFlight.from_dict, got)}

    def keep_partial(self, groups: list[GroupProgress], settled: list[int]) -> None:
        self.rt.from_rank0(lambda: self._held().in_flight.keep_partial(groups, settled), "making partial generations durable")

    def read_partial(self) -> dict[int, GroupProgress]:
        got = self.rt.from_rank0(lambda: [g.to_dict() for g in self._held().in_flight.partial_groups().values()],
                                 "reading the partial generations")
        return {g.group: g for g in map(GroupProgress.from_dict, got)}

    def attempt(self, step: int) -> int:
        return self.rt.from_rank0(lambda: attempt_at(self._held().lineage.entries(), step), "reading the run's lineage")
