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

import blake3

ORDER = ("data", "samples", "scores", "old_logprobs", "ref_logprobs", "values", "returns", "advantages", "loss", "grads", "grad_norm",
         "state")


def combine(per_rank: list[dict], state_parts: dict[str, str]) -> dict:
    """The step's stages event fields from every rank's `local()` (in rank order) and the fingerprint's parts."""
    stages = [s for s in ORDER if any(s in r["digests"] for r in per_rank)]
    digests, summary = {}, {}
    for s in stages:
        digests[s] = blake3.blake3("|".join(r["digests"].get(s, "") for r in per_rank).encode()).hexdigest()[:32]
        rows = [x for r in per_rank for x in r["stats"].get(s, [])]
        if rows:
            n = sum(x[0] for x in rows)
            summary[s] = {"n": n, "mean": (sum(x[1] for x in rows) / n) if n else 0.0, "absmax": max(x[2] for x in rows)}
    digests["state"] = blake3.blake3("|".join(f"{k}={state_parts[k]}" for k in sorted(state_parts)).encode()).hexdigest()[:32]
    return {"digests": digests, "summary": summary}


def first_difference(want: dict, got: dict) -> str | None:
    """The first stage (in the order a step computes them) whose digest differs between two stages
    events; None when they agree on every stage both have."""
    a, b = want.get("digests", {}), got.get("digests", {})
    for stage in ORDER:
        if stage in a and stage in b and a[stage] != b[stage]:
            return stage
    return None
