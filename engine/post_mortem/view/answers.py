"""What `verlj view` shows, as JSON: each answer is one of the post-mortem readers' answers
(inspection's summary and step detail, metrics' rows and find, diff; rollouts' sample columns; verify's
report) made safe for a browser's JSON.parse (NaN and infinities as null, numpy values as numbers).

Nothing here opens a file by hand: every read goes through `loop.ledger.open_run` and the readers
built on it. A run is named by the server (:class:`Runs`); a name it does not know, a step outside
the run or a search it cannot parse is a :class:`NotFound` or a `RunError` (the server's 404 / 400).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RunError
from ...loop.ledger import open_run
from ...rl.vocab import text_decoder
from ...schema.table import TURNS, sample_rows
from .. import inspection
from ..metrics import Condition, find_steps, metric_rows
from ..rollouts import iter_step_columns
from ..verify import render, verify_run

# the charts a run's page opens with (the rest are a click away): reward, KL, entropy, loss, length, timings
DEFAULT_CHARTS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                  "response_length/mean", "timing_s/step")
SAMPLES_SHOWN = 2000  # a search's sample matches, at most


class NotFound(Exception):
    """A run, step or page the viewer does not serve (a 404 with this message)."""


def plain(x: Any) -> Any:
    """`x` as JSON a browser reads: numpy scalars and arrays as Python numbers and lists, tuples as
    lists, NaN and ±inf as None, anything else unknown as its str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 2**53:
        return str(x)  # a seed: JavaScript's numbers would round it
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return plain(x.tolist())
    if hasattr(x, "value") and isinstance(x.value, (str, int)):  # enums
        return x.value
    return str(x)


@dataclass(frozen=True)
class Run:
    name: str  # its name in URLs: [A-Za-z0-9._-]
    path: Path


class Runs:
    """The runs named on the command line, and nothing else: a URL names one by its `name`."""

    def __init__(self, paths: list[Path]) -> None:
        self.runs: dict[str, Run] = {}
        for p in paths:
            base = re.sub(r"[^A-Za-z0-9._-]", "_", p.resolve().name) or "run"
            name, n = base, 2
            while name in self.runs:
                name, n = f"{base}-{n}", n + 1
            self.runs[name] = Run(name, p.resolve())
        # LMDB: one environment per path per process; the server's threads take turns reading
        self.lock = threading.Lock()

    def first(self) -> Run:
        return next(iter(self.runs.values()))

    def get(self, name: str) -> Run:
        if name not in self.runs:
            raise NotFound(f"no run named {name!r} is served here (served: {', '.join(self.runs)})")
        return self.runs[name]

    def listing(self) -> list[dict]:
        return [{"name": r.name, "path": str(r.path)} for r in self.runs.values()]


def steps_of(run: Run) -> tuple[int, int]:
    """The run's first and last committed step (first > last: none yet)."""
    with open_run(run.path) as ledger:
        return ledger.base_step() + 1, ledger.last_step()


def check_step(run: Run, step: int) -> None:
    first, last = steps_of(run)
    if not first <= step <= last:
        raise NotFound(f"step {step} is not in run {run.name}: it has steps {first}–{last}" if first <= last
                       else f"step {step} is not in run {run.name}: no step is committed yet")


def summary(run: Run) -> dict:
    """The run at a glance: inspection's summary (`verlj inspect RUN --json`) and the default charts."""
    s = inspection.run_summary(run.path)
    return plain({"name": run.name, **s.to_json(), "default_charts": list(DEFAULT_CHARTS)})


def metrics(run: Run, after: int) -> dict:
    """Every metric of every step after `after` (`verlj metrics RUN --jsonl`'s rows): the page polls it."""
    cols, found = metric_rows(run.path, None, f"{after + 1}:")
    return plain({"names": cols, "rows": found})


def verification(run: Run) -> dict:
    """`verlj verify RUN` (shallow: manifests, the hash chain; no file hashing beyond what verify does)."""
    from ...dist import prepare_accelerator

    prepare_accelerator()  # before verify loads DeepSpeed: its CPU accelerator chosen quietly, as `verlj verify` does
    report = verify_run(run.path)
    return plain({"ok": report.ok, "last_step": report.last_step, "text": render(report)})


def step(run: Run, n: int) -> dict:
    """`verlj inspect RUN --step N --json`, each sample with its response token by token: the token's
    text, its generation log-prob and whether the policy produced it (an episode's observations: not)."""
    check_step(run, n)
    first, last = steps_of(run)
    detail = inspection.step_detail(run.path, n)
    tokens = _tokens(run, n)
    samples = [{**s.to_json(), "tokens": tokens.get(s.id)} for s in detail.samples]
    return plain({"name": run.name, **detail.to_json(), "samples": samples, "first_step": first, "last_step": last})


def _tokens(run: Run, n: int) -> dict[int, list]:
    """sample id -> [[text, log-prob, policy's], ...] per response token, from the step's sample columns."""
    out: dict[int, list] = {}
    with open_run(run.path) as ledger:
        decoder = text_decoder(ledger.config_at(n))
        for _, cols in iter_step_columns(run.path, ledger, n, n, []):
            for row in sample_rows(cols, TURNS in cols):
                ids, lps, mask = row.response_ids, row.gen_logprobs, row.loss_mask
                out[row.sample_id] = [
                    [decoder.decode([t], skip_special_tokens=False) if decoder else str(t), lp, bool(mask[i]) if mask else True]
                    for i, (t, lp) in enumerate(zip(ids, lps))]
    return out


def compare(a: Run, b: Run) -> dict:
    """`verlj diff A B --json`: the first step where the journals differ, what differs there, and the
    first differing stage (from the journal; no step is re-executed)."""
    d = inspection.first_difference(a.path, b.path).to_json()
    return plain({"a": a.name, "b": b.name, **d})


_SCORE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(-?[0-9.eE+-]+)\s*$")


def search(run: Run, where: str, text: str, score: str, faults: bool) -> dict:
    """`verlj find RUN --where ...` over the metrics, and the samples whose prompt or response holds
    `text`, whose score matches `score` (e.g. '> 0.5') and, with `faults`, whose episode ended in a fault."""
    steps = [m.to_json() for m in find_steps(run.path, where)] if where.strip() else None
    cond = None
    if score.strip():
        m = _SCORE.match(score)
        if not m:
            raise RunError(f"cannot parse score {score!r}: write an operator and a number, e.g. '> 0.5'")
        try:
            cond = Condition("score", m.group(1), float(m.group(2)))
        except ValueError:
            raise RunError(f"cannot parse score {score!r}: {m.group(2)!r} is not a number") from None
    samples, truncated = _samples(run, text, cond, faults) if text or cond is not None or faults else (None, False)
    return plain({"name": run.name, "where": where, "steps": steps, "samples": samples, "truncated": truncated})


def _samples(run: Run, text: str, cond, faults: bool) -> tuple[list[dict], bool]:
    found: list[dict] = []
    with open_run(run.path) as ledger:
        for n, cols in iter_step_columns(run.path, ledger, ledger.base_step() + 1, ledger.last_step(), []):
            for row in sample_rows(cols, TURNS in cols):
                said = f"{row.prompt or ''}\n{row.response or ''}"
                if text and text not in said:
                    continue
                if cond is not None and not cond({"score": row.score}):
                    continue
                if faults and not row.env_reason:
                    continue
                if len(found) == SAMPLES_SHOWN:
                    return found, True
                found.append({"step": n, "id": row.sample_id, "group": row.group, "prompt": row.prompt,
                              "response": row.response, "score": row.score, "env_reason": row.env_reason})
    return found, False
