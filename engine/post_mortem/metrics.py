"""`verlj metrics` and `verlj find`: a run's journaled metrics (and its probes', beside the journal)
as one row a step, and the steps where a condition on them holds.

    verlj metrics RUN --names actor/pg_loss --steps 100:200 [--csv | --jsonl | --plot out.png]
    verlj find RUN --where 'actor/grad_norm > 10'

Both read the journal's summaries (no samples: Ledger.metrics), so they stream a long run quickly.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..loop.ledger import open_run
from . import derived
from .steps import parse_steps


def metric_rows(run_dir: Path, names: list[str] | None, steps: str | None) -> tuple[list[str], list[dict]]:
    """The metric names shown and one row a step: {"step": step, name: value, ...} (--jsonl's lines)."""
    start, stop = parse_steps(steps)
    rows, seen, at = [], set(), []
    probed = derived.values(run_dir)  # `verlj replay --probe`'s, beside the journal
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics(start, stop):
            values = {**values, **probed.get(step, {})}
            seen |= set(values)
            rows.append({"step": step, **(values if names is None else {k: values.get(k) for k in names})})
            at.append(step)
    if names is not None:
        unknown = [n for n in names if n not in seen]
        if unknown and rows:  # measured after a step's commit, some metrics are only in the logs
            logged = _logged_only(Path(run_dir) / "metrics.jsonl", set(unknown))
            for step, row in zip(at, rows):
                row.update(logged.get(step, {}))
            found = {k for values in logged.values() for k in values}
            unknown = [n for n in unknown if n not in found]
        if unknown and rows:
            raise UsageError(f"unknown metric {unknown[0]!r}; this run has: {', '.join(sorted(seen))}")
        cols = names
    else:
        cols = sorted(seen)
    return cols, rows


def _logged_only(path: Path, names: set[str]) -> dict[int, dict[str, float]]:
    """step -> {name: value} of `names` in metrics.jsonl: the metrics measured after a step's commit
    (timing_s/commit, journal/ship_lag_steps: run.train_loop logs them), which its record cannot hold."""
    out: dict[int, dict[str, float]] = {}
    try:
        f = open(path)
    except OSError:
        return out
    with f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            hit = {k: row[k] for k in names if k in row}
            if hit and isinstance(step := row.get("step"), int):
                out.setdefault(step, {}).update(hit)
    return out


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}
_COND = re.compile(r"^\s*([\w/.\-]+)\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$|^\s*([\w/.\-]+)\s+is\s+(nan|inf|not finite)\s*$")


@dataclass
class Condition:
    name: str
    op: str
    value: float | None

    def __call__(self, values: dict) -> bool:
        v = values.get(self.name)
        if v is None:
            return False
        if self.op == "nan":
            return math.isnan(v)
        if self.op == "inf":
            return math.isinf(v)
        if self.op == "not finite":
            return not math.isfinite(v)
        assert self.value is not None  # NAME OP NUMBER
        return _OPS[self.op](v, self.value)


def parse_where(where: str) -> list[Condition]:
    """'actor/grad_norm > 10 and critic/score/mean < 0.1', or 'actor/pg_loss is nan'."""
    conds = []
    for part in re.split(r"\s+and\s+", where.strip()):
        m = _COND.match(part)
        if not m:
            raise UsageError(
                f"cannot parse --where {where!r}: use NAME OP NUMBER (OP one of > >= < <= == !=) or NAME is nan|inf|not finite, joined by 'and'"
            )
        if m.group(1):
            try:
                conds.append(Condition(m.group(1), m.group(2), float(m.group(3))))
            except ValueError:
                raise UsageError(f"cannot parse --where {where!r}: {m.group(3)!r} is not a number") from None
        else:
            conds.append(Condition(m.group(4), m.group(5), None))
    return conds


@dataclass(frozen=True)
class Match:
    """A step `verlj find` found, with the values of the metrics its condition names."""

    step: int
    values: dict[str, float | None]

    def to_json(self) -> dict:
        return {"step": self.step, **self.values}


def find_steps(run_dir: Path, where: str, limit: int | None = None) -> list[Match]:
    conds = parse_where(where)
    out = []
    names_seen: set[str] = set()
    probed = derived.values(run_dir)
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics():
            values = {**values, **probed.get(step, {})}
            names_seen |= set(values)
            if all(c(values) for c in conds):
                out.append(Match(step, {c.name: values.get(c.name) for c in conds}))
                if limit is not None and len(out) >= limit:
                    break
    missing = [c.name for c in conds if names_seen and c.name not in names_seen]
    if missing:
        raise UsageError(f"unknown metric {missing[0]!r} in --where")
    return out
