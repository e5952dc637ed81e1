"""The run being driven: one object for what every part of the loop needs, handed around whole.

    run = make_run(run_dir, rt, trainer, reporter, ledger)  # loop.checkpointer; ledger: rank 0's, None on the others
                                                             # (its rollout source assembled: rl.sources.make_source)
    last, control = resume(run, changed, allow_change)       # loop.recovery
    train_loop(run, last, control, stop)                     # loop.run

The journal is rank 0's alone: what the other ranks must know of it reaches them through
``Runtime.from_rank0`` (the run's history once per resume or replay: :meth:`Run.history`; each
replayed record; each commit's outcome). Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .records import History

if TYPE_CHECKING:
    from ..config import Config
    from ..dist import Runtime
    from ..report import Reporter
    from ..rl.sources import StepSource
    from ..rl.trainer import Trainer
    from ..state.topology import Topology
    from .checkpointer import Checkpointer
    from .ledger import Ledger


@dataclass
class Run:
    """Made whole, once, by make_run (loop.checkpointer), which builds its checkpointer first.

    One config: the trainer's (:attr:`cfg`). What stays fixed for the process while a replay moves
    the trainer through older configs (its topology, the snapshot schedule) is taken from that config
    when the run is made."""

    run_dir: Path
    rt: Runtime
    trainer: Trainer
    reporter: Reporter
    ledger: Ledger | None  # the run's history in its journal: rank 0 only
    topology: Topology  # this process's: its ranks, TP size and ZeRO stage (what a snapshot of another is resharded to)
    ckpt: Checkpointer
    source: StepSource  # what collects each live step's inputs (rl.sources), assembled for the run's config; replay puts back
    # the buffer changes of journaled steps through it

    @property
    def cfg(self) -> Config:
        """The run's config, the one its state is under: the run's own (a start's, a resume's, a fork's,
        a replay's target step's), except while a replay moves the trainer through the configs the
        journal recorded at each step (loop.recovery), which sets it back after."""
        return self.trainer.cfg

    def main_ledger(self) -> Ledger:
        """The run's ledger, on rank 0, the one rank that holds it (what only rank 0 runs asks for it)."""
        assert self.ledger is not None, "the ledger is rank 0's"
        return self.ledger

    def closed_ledger(self) -> None:
        """Its ledger was closed (a replay to a step is done reading it): what the replayed state is used for next
        (an export, a --snapshot elsewhere, a --fork) records nothing in this run's history."""
        self.ledger = None

    def history(self) -> History:
        """The run's history, read on rank 0 and sent to every rank (collective)."""
        return History.from_dict(self.rt.from_rank0(lambda: self.main_ledger().history().to_dict(), "reading the run's history"))
