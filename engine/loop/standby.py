"""The standby's head start: what a standby (cli/supervise.py) builds before the supervisor tells it to go.

A standby is the same `verlj train` command with --resume, started beside the trainer while restarts remain.
Where it can, it builds the trainer (models, DeepSpeed engines, data, rewards) for the config the command gives
a run it starts, then waits: a restart then goes straight to loading the newest mirror or snapshot. After "go",
`verlj train` resolves the run's config as any resume does (loop.run.check_start) and takes the prebuilt trainer
only when that config is the one it was built for, every key alike; otherwise it closes it and builds another
(a config changed by an earlier --resume, say), which is today's restart. Nothing of the run directory is read
or written before "go": the trainer is built from the command alone.

Where it cannot: a run on a GPU (a second copy of the model there would take the trainer's memory; its standby
only imports), a command whose config does not resolve (the restart says why), and a machine without room for
a second copy in host memory (after building, less memory available than the copy took: it is dropped, in one
line, and the standby only imports).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Config, make_config

if TYPE_CHECKING:
    from ..dist import Runtime
    from ..rl.trainer import Trainer


@dataclass
class Prebuilt:
    """A trainer a standby built for the config `stored` (Config.to_stored())."""

    stored: dict
    trainer: Trainer | None  # None once taken or closed: nothing of it is held here after

    def take(self, cfg: Config) -> Trainer | None:
        """The prebuilt trainer when `cfg` (the run's, resolved after "go") is the config it was built for; else
        None, the prebuilt one closed (and let go: its data, tokenizer and rewards too)."""
        trainer, self.trainer = self.trainer, None
        if trainer is not None and cfg.to_stored() == self.stored:
            return trainer
        if trainer is not None:
            trainer.close()
        return None


def trainer_for(cfg: Config, rt: Runtime, prebuilt: Prebuilt | None, say) -> Trainer:
    """The run's trainer: the standby's, where it was built for `cfg`, else one built now; `say` gets the line that
    says which, when there was a standby."""
    from ..rl.trainer import Trainer

    taken = prebuilt.take(cfg) if prebuilt is not None else None
    if taken is not None:
        say("Took the trainer the standby built before the restart (models, DeepSpeed engines, data).")
        return taken
    if prebuilt is not None:
        say("The standby built its trainer for the command's config, and the run's is another (a --resume changed it): "
            "built the run's instead.")
    return Trainer(cfg, rt)


def _available() -> int | None:
    """MemAvailable of /proc/meminfo, bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def prebuild(config_file, overrides: list[str], say) -> Prebuilt | None:
    """In a standby, before it waits: the trainer for the command's config, where it can be built (see the module's
    docstring); None where not (`say`: one line when memory was the reason)."""
    import torch

    try:
        cfg = make_config(config_file, list(overrides))
    except Exception:  # noqa: BLE001 - the restart resolves the config again and says what is wrong with it
        return None
    if cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available()):
        return None
    from ..dist import configure_determinism, setup
    from ..rl.trainer import Trainer

    before = _rss()
    try:
        rt = setup(cfg)
        configure_determinism(cfg)
        trainer = Trainer(cfg, rt)
    except Exception:  # noqa: BLE001 - as above: the restart builds it again and fails in its own words
        return None
    took, free = _rss() - before, _available()
    if free is not None and free < took:
        trainer.close()
        say(f"the standby dropped the trainer it built ({took / 2**20:,.0f} MiB): {free / 2**20:,.0f} MiB of memory is left "
            "available; it waits with its libraries imported only")
        return None
    return Prebuilt(cfg.to_stored(), trainer)
