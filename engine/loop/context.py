"""The run being driven: one object for what every part of the loop needs, handed around whole.

    run = make_run(run_dir, cfg, rt, trainer, reporter, ledger)  # loop.checkpointer; ledger: rank 0's, None on the others
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

from .ledger import History

if TYPE_CHECKING:
    from ..config import Config
    from ..dist import Runtime
    from ..report import Reporter
    from ..rl.trainer import Trainer
    from .checkpointer import Checkpointer
    from .ledger import Ledger


@dataclass
class Run:
    run_dir: Path
    cfg: Config  # the config this process runs under (a resume's, a fork's, a replay's target step's)
    rt: Runtime
    trainer: Trainer
    reporter: Reporter
    ledger: Ledger | None = None  # the run's history in its journal: rank 0 only
    ckpt: Checkpointer | None = None  # built from the run by make_run (loop.checkpointer), which makes every Run

    def history(self) -> History:
        """The run's history, read on rank 0 and sent to every rank (collective)."""
        return History(**self.rt.from_rank0(lambda: self.ledger.history().to_dict(), "reading the run's history"))
