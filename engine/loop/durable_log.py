"""The run's durable log: where completion order makes what is in flight durable between two commits (a group of
episodes after each turn, an agent's calls as they are answered, the generations a push stopped), over the run's
ledger (``ledger.in_flight``: the journal's pending store). Rank 0 writes and reads; every rank waits for it
(``Runtime.from_rank0``). The rollout's players are made with it (``rl.sources.players.InFlightLog``), and reach the
journal through it alone: player -> :class:`DurableLog` -> ``InFlight`` (the ledger's) -> ``journal.pending``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schema.sample import GroupInFlight, GroupProgress
from .records import attempt_at

if TYPE_CHECKING:
    from ..dist import Runtime
    from .ledger import Ledger
    from .ledger.in_flight import InFlight


class DurableLog:
    """rl.sources.InFlightLog over the run's ledger (rank 0's; None on the other ranks): each write one transaction of
    the ledger's in-flight entries (``ledger.in_flight``), every rank waiting for it."""

    def __init__(self, rt: Runtime, ledger: Ledger | None):
        self.rt, self.ledger = rt, ledger
        self.in_flight: InFlight | None = ledger.in_flight if ledger is not None else None

    def _held(self) -> InFlight:
        assert self.in_flight is not None, "the ledger is rank 0's"
        return self.in_flight

    def keep_in_flight(self, groups: list[GroupInFlight], settled: list[int], calls: list | None = None, dropped: list | None = None,
                       tools: list | None = None, dropped_tools: list | None = None) -> None:
        def write() -> None:  # rank 0's
            self._held().write_in_flight(groups, settled, calls or (), dropped or (), tools or (), dropped_tools or ())

        self.rt.from_rank0(write, "making episodes' turns durable")

    def read_in_flight(self) -> dict[int, GroupInFlight]:
        got = self.rt.from_rank0(lambda: [g.to_dict() for g in self._held().groups().values()], "reading the episodes in flight")
        return {g.group: g for g in map(GroupInFlight.from_dict, got)}

    def read_tools(self) -> dict[int, list[dict]]:
        got = self.rt.from_rank0(lambda: {g: [c.to_dict() for c in calls] for g, calls in self._held().tool_calls().items()},
                                 "reading the tool calls in flight")
        return {int(g): calls for g, calls in got.items()}

    def run_token(self) -> str:
        def token() -> str:  # rank 0's: the run's identity, recorded once at its start
            assert self.ledger is not None, "the ledger is rank 0's"
            return self.ledger.identity.run_token()

        return self.rt.from_rank0(token, "reading the run's identity")

    def keep_stopped(self, groups: list[GroupProgress], settled: list[int]) -> None:
        def write() -> None:  # rank 0's
            self._held().write_stopped(groups, settled)

        self.rt.from_rank0(write, "making partial generations durable")

    def read_stopped(self) -> dict[int, GroupProgress]:
        got = self.rt.from_rank0(lambda: [g.to_dict() for g in self._held().partial_groups().values()], "reading the partial generations")
        return {g.group: g for g in map(GroupProgress.from_dict, got)}

    def attempt(self, step: int) -> int:
        def lineage() -> int:  # rank 0's
            assert self.ledger is not None, "the ledger is rank 0's"
            return attempt_at(self.ledger.lineage.entries(), step)

        return self.rt.from_rank0(lineage, "reading the run's lineage")
