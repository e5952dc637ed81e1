"""The memory mirror: the state after a recent committed step, held in this machine's shared memory, so that a
trainer restarted here loads it instead of a snapshot from disk and replays fewer journaled steps.

    /dev/shm/verlj-mirror-<digest of the run directory's path>/   (trainer.mirror_dir, default /dev/shm)
      step_00041/          the newest whole mirror: a snapshot's files and manifest (checkpointer.py writes them)
      step_00040/          the one before it: kept until the next is whole (two slots)
      .tmp-step_00042/     being written (never read; removed by the next publish)

A mirror is a snapshot in every file but its place: never in the run's index, never rotated by
save_total_limit, never fsynced (it serves a restart on a live machine; a machine that lost power lost it
anyway). It is published as a snapshot is (its manifest with every file's size and BLAKE3 digest, then one
rename), so a process killed mid-copy leaves the previous mirror whole. Recovery (loop.recovery) takes the
newest mirror whose manifest, step and fingerprint check out against the journal, when it is at least as
new as every valid snapshot on disk; a damaged one is skipped in one line. The mirror is this module's: its
place, its publishing, its two slots and its space; no torch here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import blake3

from verlj.journal.space import files_under, free_bytes

from ..state.manifest import MANIFEST, build_manifest, snapshot_name

_MIRROR = re.compile(r"^step_(\d+)$")
SLOTS = 2


def default_dir() -> Path:
    """Where mirrors go when trainer.mirror_dir is not set: /dev/shm (memory) where the machine has it."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def mirror_root(run_dir: Path, mirror_dir: str | None) -> Path:
    """The run's mirror directory: one per run directory (by its absolute path) under `mirror_dir`."""
    where = Path(mirror_dir) if mirror_dir else default_dir()
    key = blake3.blake3(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return where / f"verlj-mirror-{key}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


class Mirror:
    """The run's mirrors under `root` (mirror_root): which steps are due, where the next is written, publishing it
    (manifest, rename, the slot before it kept, every other removed), the ones a recovery may take, and the space."""

    def __init__(self, root: Path, interval: int):
        self.root = Path(root)
        self.interval = interval
        self.last_bytes: int | None = None  # the last mirror published by this process: its size

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".tmp-{snapshot_name(step)}"

    def publish(self, step: int, tmp: Path) -> Path:
        """The written mirror `tmp` made the mirror of `step`: manifest, rename; then every mirror but it and the
        newest older one removed (a mirror of a later step is a timeline the journal no longer holds)."""
        (tmp / MANIFEST).write_text(json.dumps(build_manifest(tmp), indent=1))
        final = self.root / snapshot_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.last_bytes = dir_bytes(final)
        older = [s for s in self.steps() if s < step]
        keep = {step, *sorted(older)[-(SLOTS - 1):]}
        for child in list(self.root.iterdir()):
            s = _step_of(child.name)
            if (s is None or s not in keep) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
        return final

    def steps(self) -> list[int]:
        """The steps of the published mirrors, oldest first (none while the directory does not exist)."""
        if not self.root.is_dir():
            return []
        return sorted(s for p in self.root.iterdir() if (s := _step_of(p.name)) is not None and p.is_dir())

    def candidates(self, limit: int) -> list[tuple[int, Path]]:
        """The published mirrors at or before `limit`, newest first (recovery checks each before taking one)."""
        return [(s, self.root / snapshot_name(s)) for s in reversed(self.steps()) if s <= limit]

    def room(self, need: int) -> tuple[bool, int]:
        """Whether `need` more bytes fit where the mirrors go (the filesystem's free space), and that space."""
        free = free_bytes(self.root)  # (its nearest existing parent: another rank may not have made it yet)
        if free is None:
            raise OSError(f"the free space under {self.root} cannot be read")
        return free >= need, free

    def clear(self) -> None:
        """Every mirror of the run removed (the run finished: its final snapshot is on disk)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def discard(self, path: Path) -> None:
        """One mirror removed (one that loaded as another state than it recorded)."""
        shutil.rmtree(path, ignore_errors=True)


def _step_of(name: str) -> int | None:
    m = _MIRROR.match(name)
    return int(m.group(1)) if m else None
