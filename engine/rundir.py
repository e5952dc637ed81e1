"""A run directory's layout and the small helpers around it (no torch: every command can use it)."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from verlj.journal import Journal

from .errors import RunError  # noqa: F401  (re-exported)


def journal_dir(run_dir: Path) -> Path:
    return run_dir / "journal"


def has_run(run_dir: Path) -> bool:
    """A journal with a run's metadata. (One without it died before its first write: not a run yet.)"""
    if not (journal_dir(run_dir) / "data.mdb").is_file():
        return False
    with Journal.open_reader(journal_dir(run_dir)) as j:
        return j.get_meta("config") is not None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
