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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import msgpack

from verlj.journal.durable import replace_durably

from ..errors import RunError
from ..schema.record import Record

DIR = "derived"
PREFIX = "probe/"


def metric_name(probe: str, key: str) -> str:
    return f"{PREFIX}{probe}/{key.removeprefix(PREFIX)}"


@dataclass(frozen=True)
class Row:
    """A probe's numbers for one step (what `verlj replay --probe` prints, one JSON line a step). Not a record of
    the codec: its line holds the step beside the values, flat, where a record's map holds each field under its name."""

    step: int
    values: dict[str, float]

    def to_dict(self) -> dict:
        return {"step": self.step, **self.values}


@dataclass(frozen=True)
class ProbeFile(Record):
    """One probe's stored values: ``RUN/derived/<probe>.msgpack`` holds ``to_dict()``."""

    probe: str
    version: str | None
    steps: dict[int, dict[str, float]]  # {step: {name: value}}, steps ascending

    @classmethod
    def parse(cls, data) -> ProbeFile | None:
        """The file's map read back; None when `data` is not a map of this shape."""
        if not isinstance(data, dict):
            return None
        stored: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        raw = cls(**stored)  # the values as stored, none made its type
        return cls.from_dict(data) if isinstance(raw.steps, dict) and isinstance(raw.probe, str) else None


def _path(run_dir: Path, probe: str) -> Path:
    return Path(run_dir) / DIR / f"{probe}.msgpack"


def _read(path: Path) -> ProbeFile:
    try:
        data = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise RunError(f"derived metrics file {path} is damaged ({e}); delete it and run the probe again") from None
    stored = ProbeFile.parse(data)
    if stored is None:
        raise RunError(f"derived metrics file {path} is not one verlj wrote; delete it and run the probe again")
    return stored


def store(run_dir: Path, probe: str, version: str, rows: list[Row]) -> str | None:
    """Merge `rows` into the probe's file; returns a note when values of another version were dropped."""
    path = _path(run_dir, probe)
    steps: dict[int, dict[str, float]] = {}
    note = None
    if path.exists():
        old = _read(path)
        if old.version == version:
            steps = {int(s): v for s, v in old.steps.items()}
        else:
            note = f"probe {probe}: version {old.version} → {version}; the older version's values were dropped"
    for row in rows:
        steps[int(row.step)] = {k: float(v) for k, v in row.values.items()}
    blob = msgpack.packb(ProbeFile(probe, version, dict(sorted(steps.items()))).to_dict(), use_bin_type=True)
    path.parent.mkdir(exist_ok=True)
    replace_durably(path, blob)
    return note


def probes(run_dir: Path) -> list[dict]:
    """[{probe, version, steps: [first, last], count}] for every stored probe."""
    out = []
    for path in sorted((Path(run_dir) / DIR).glob("*.msgpack")):
        stored = _read(path)
        steps = sorted(int(s) for s in stored.steps)
        out.append({"probe": stored.probe, "version": stored.version, "count": len(steps),
                    "steps": [steps[0], steps[-1]] if steps else []})
    return out


def values(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {probe/<probe>/<name>: value} over every stored probe."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted((Path(run_dir) / DIR).glob("*.msgpack")):
        stored = _read(path)
        for s, metrics in stored.steps.items():
            row = out.setdefault(int(s), {})
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    row[metric_name(stored.probe, k)] = float(v)
    return out
