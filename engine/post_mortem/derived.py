"""Derived metrics: numbers computed after the fact over a run's past steps (`verlj replay --steps
A:B --probe module:function`), kept beside the journal, never in its hash-chained step records
(whose checksums they leave alone).

One file a probe, ``RUN/derived/<module.function>.msgpack``: ``{"probe", "version", "steps": {step:
{name: value}}}``, written whole to a temporary file, fsynced and renamed over the old one, so a
reader sees the old file or the new one. `metrics`, `find` and `inspect` show them as
``probe/<module.function>/<name>``. A probe's version is its ``version`` attribute, else its
module's ``__version__``, else a digest of its module's source: values of another version are
replaced, not mixed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgpack

from ..errors import RunError

DIR = "derived"
PREFIX = "probe/"


def metric_name(probe: str, key: str) -> str:
    return f"{PREFIX}{probe}/{key.removeprefix(PREFIX)}"


def _path(run_dir: Path, probe: str) -> Path:
    return Path(run_dir) / DIR / f"{probe}.msgpack"


def _read(path: Path) -> dict:
    try:
        data = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise RunError(f"derived metrics file {path} is damaged ({e}); delete it and run the probe again") from None
    if not (isinstance(data, dict) and isinstance(data.get("steps"), dict) and isinstance(data.get("probe"), str)):
        raise RunError(f"derived metrics file {path} is not one verlj wrote; delete it and run the probe again")
    return data


def store(run_dir: Path, probe: str, version: str, rows: list[dict]) -> str | None:
    """Merge `rows` ([{"step": s, name: value}]) into the probe's file; returns a note when values
    of another version were dropped."""
    path = _path(run_dir, probe)
    steps: dict[int, dict[str, float]] = {}
    note = None
    if path.exists():
        old = _read(path)
        if old.get("version") == version:
            steps = {int(s): v for s, v in old["steps"].items()}
        else:
            note = f"probe {probe}: version {old.get('version')} → {version}; the older version's values were dropped"
    for row in rows:
        steps[int(row["step"])] = {k: float(v) for k, v in row.items() if k != "step"}
    blob = msgpack.packb({"probe": probe, "version": version, "steps": dict(sorted(steps.items()))}, use_bin_type=True)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return note


def probes(run_dir: Path) -> list[dict]:
    """[{probe, version, steps: [first, last], count}] for every stored probe."""
    out = []
    for path in sorted((Path(run_dir) / DIR).glob("*.msgpack")):
        data = _read(path)
        steps = sorted(int(s) for s in data["steps"])
        out.append({"probe": data["probe"], "version": data.get("version"), "count": len(steps),
                    "steps": [steps[0], steps[-1]] if steps else []})
    return out


def values(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {probe/<probe>/<name>: value} over every stored probe."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted((Path(run_dir) / DIR).glob("*.msgpack")):
        data = _read(path)
        for s, metrics in data["steps"].items():
            row = out.setdefault(int(s), {})
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    row[metric_name(data["probe"], k)] = float(v)
    return out
