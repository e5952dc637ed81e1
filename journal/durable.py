"""Durable files, shared by the journal and the engine (the engine may import the journal, never the reverse).

    replace_durably(path, data)   a file replaced atomically and durably: a reader, or a crash, finds the
                                  old file or the new one, whole (train_metadata.json, a probe's file, a
                                  claim's renewal, the shipped journal's pointer)
    publish_file(tmp, path)       the same for a temporary file already written (an archive's Parquet file,
                                  a rebuilt journal's copy): fsynced, renamed over `path`, the directory fsynced
    write_synced(path, data)      written and fsynced, not atomic: a file of a directory that is made visible
                                  whole later (a snapshot's files, renamed into place with their directory)
    fsync_file, fsync_dir         what they say
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes | Iterable[bytes]) -> None:
    """`path` created (or truncated) holding `data` (bytes, or its parts in order), fsynced before this returns."""
    with open(path, "wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            f.writelines(data)
        f.flush()
        os.fsync(f.fileno())


def publish_file(tmp: Path, path: Path, before: Callable[[], None] | None = None) -> None:
    """The written file `tmp` (beside `path`) made `path`, durably: fsynced, renamed over `path` (rename(2): a
    reader sees the old file or the new one), the directory fsynced. `before()`: called just before the rename
    (a writer's fencing: one whose claim was taken over publishes nothing)."""
    fsync_file(tmp)
    _rename_durably(tmp, path, before)


def replace_durably(path: Path, data: bytes | Iterable[bytes], tmp: Path | None = None) -> None:
    """`path` replaced by `data` (bytes, or its parts in order) atomically and durably: written to `tmp` (default:
    PATH.tmp beside it), fsynced, renamed over `path`, the directory fsynced."""
    tmp = Path(path).with_name(Path(path).name + ".tmp") if tmp is None else tmp
    write_synced(tmp, data)
    _rename_durably(tmp, path, None)


def _rename_durably(tmp: Path, path: Path, before: Callable[[], None] | None) -> None:
    if before is not None:
        before()
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)
