"""Why a write failed, in words a user acts on: a full disk or the file-size limit (`ulimit -f`).

Libraries report both badly: LMDB turns a short write into EIO (`mdb_txn_commit: Input/output
error`), torch.save into `[enforce fail at inline_container.cc:672] . unexpected pos A vs B`. So the
cause is read from the world after the failure: the free space under the directory written to, and
the process's RLIMIT_FSIZE against the largest file it wrote.
"""

from __future__ import annotations

import errno
import resource
import shutil
from collections.abc import Sequence
from pathlib import Path

LOW_SPACE = 16 << 20  # under this much free, a failed write is put down to the full disk


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int | None:
    """Free space for this process under `path` (its nearest existing ancestor), or None if unknown."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def file_size_limit() -> int | None:
    """The process's soft RLIMIT_FSIZE in bytes (`ulimit -f`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure_cause(error: BaseException, where: Path, written: Sequence[Path] = ()) -> str | None:
    """'no space left on the run directory's disk (N free)' or 'file-size limit (ulimit -f) of N
    reached by FILE', when either explains `error` (raised writing under `where`, the files in
    `written` being what was written); None when neither does."""
    code = error.errno if isinstance(error, OSError) else None
    limit = file_size_limit()
    if limit is not None:
        sizes = []
        for p in written:
            try:
                sizes.append((Path(p).stat().st_size, Path(p)))
            except OSError:
                continue
        hit = [p for size, p in sizes if size >= limit]
        if code == errno.EFBIG or hit:
            at = f" by {hit[0].name}" if hit else ""
            return f"file-size limit (ulimit -f) of {human_bytes(limit)} reached{at}"
    free = free_bytes(where)
    if code == errno.ENOSPC or "No space left" in str(error) or (free is not None and free < LOW_SPACE):
        said = f"{human_bytes(free)} free" if free is not None else "free space unknown"
        return f"no space left on the run directory's disk ({said})"
    return None


def files_under(path: Path) -> list[Path]:
    """Every file under `path` (a directory being written), for write_failure_cause."""
    path = Path(path)
    try:
        return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    except OSError:
        return []
