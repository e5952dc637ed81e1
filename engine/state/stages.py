"""Stage digests: a digest and a few summary numbers of each stage's output in a step, journaled
beside the fingerprint, so a post-mortem can name the first stage where two runs (or a run and its
re-execution) part.

The stages, in the order a step computes them: ``data`` (the sample ids the update trains on and
their dataset rows), ``samples`` (their prompt and response ids), ``scores``, ``old_logprobs``,
``ref_logprobs``, ``advantages`` (and ``values``, ``returns`` for PPO), ``loss`` (every
micro-batch's loss, in order), ``grads`` (every parameter's local gradient at each optimizer step,
before clipping: where DeepSpeed leaves it, in ``.grad`` (ZeRO-0, TP) or this rank's partition
(ZeRO-1/2/3)), ``grad_norm`` (each optimizer step's, before clipping: computed from the gradients) and
``state`` (the fingerprint's parts).

Tensors are reduced where they live with :func:`~.fingerprint.tensor_sums` (the recorder:
``stage_recorder``); each rank digests its own share and the shares are combined in rank order, like
the fingerprint. Summaries (count, mean, absolute max) are over every rank's values. This module
loads no torch: the post-mortem readers compare journaled stages with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

from ..schema.events import Stages
from ..schema.record import Record

STATE = "state"  # the last stage: the fingerprint's parts
ORDER = ("data", "samples", "scores", "old_logprobs", "ref_logprobs", "values", "returns", "advantages", "loss", "grads", "grad_norm",
         STATE)


@dataclass(frozen=True)
class RankStages(Record):
    """One rank's share of a step's stages (stage_recorder.local): each stage's digest, and its
    [count, sum, absmax] rows. Crosses ranks as `to_dict()` (msgpack)."""

    digests: dict[str, str]
    stats: dict[str, list[list[float]]]


def combine(per_rank: list[dict], state_parts: dict[str, str]) -> dict:
    """The step's stages event fields from every rank's `local()` (RankStages maps, in rank order) and the fingerprint's parts."""
    shares = [RankStages.from_dict(r) for r in per_rank]
    stages = [s for s in ORDER if any(s in r.digests for r in shares)]
    digests, summary = {}, {}
    for s in stages:
        digests[s] = blake3.blake3("|".join(r.digests.get(s, "") for r in shares).encode()).hexdigest()[:32]
        rows = [x for r in shares for x in r.stats.get(s, [])]
        if rows:
            n = sum(x[0] for x in rows)
            summary[s] = {"n": n, "mean": (sum(x[1] for x in rows) / n) if n else 0.0, "absmax": max(x[2] for x in rows)}
    digests[STATE] = blake3.blake3("|".join(f"{k}={state_parts[k]}" for k in sorted(state_parts)).encode()).hexdigest()[:32]
    return {"digests": digests, "summary": summary}


def first_difference(want: dict, got: dict) -> str | None:
    """first_digest_difference of two stages events' fields (as journaled: {digests, summary})."""
    return first_digest_difference(Stages.from_event(want).digests, Stages.from_event(got).digests)


def first_digest_difference(a: dict[str, str], b: dict[str, str]) -> str | None:
    """The first stage (in the order a step computes them) whose digest differs between two steps'
    stage digests; None when they agree on every stage both have."""
    for stage in ORDER:
        if stage in a and stage in b and a[stage] != b[stage]:
            return stage
    return None


def first_element_difference(a: list[tuple[str, np.ndarray]], b: list[tuple[str, np.ndarray]]) -> dict | None:
    """Between two stages' values (``[(name, array)]``, in the order the step produced them): the
    first part and element whose bits differ, both values, and the largest absolute difference over
    the stage's parts of equal shape. None when they agree bit for bit."""
    first: dict | None = None
    largest = 0.0
    for (name, x), (_, y) in zip(a, b):
        x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
        if x.shape != y.shape:
            if first is None:
                first = {"part": name, "index": None, "a": f"shape {x.shape}", "b": f"shape {y.shape}"}
            continue
        if x.dtype == y.dtype and x.tobytes() == y.tobytes():
            continue
        diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
        if diff.size:
            largest = max(largest, float(np.nanmax(diff)) if not np.all(np.isnan(diff)) else float("nan"))
        if first is None:
            xb, yb = x.view(np.uint8).reshape(x.size, -1), y.view(np.uint8).reshape(y.size, -1)
            k = int(np.flatnonzero((xb != yb).any(axis=1))[0]) if x.dtype == y.dtype else int(np.flatnonzero(x != y)[0])
            first = {"part": name, "index": k, "a": x[k].item(), "b": y[k].item()}
    if first is None and len(a) != len(b):
        first = {"part": f"{len(a)} vs {len(b)} parts", "index": None, "a": None, "b": None}
    return None if first is None else {**first, "largest_abs_diff": largest}
