"""The deterministic half of a step (``apply``): from the consumed samples, the log-probs of the policy
the step starts from (and the reference's), the advantages (values and returns for PPO), the DeepSpeed
updates of the actor (and critic), the metrics, the stage digests and the fingerprint of the state
after. Live training and replay both come through :func:`apply`: the same inputs give the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from verlj.journal.failpoints import failpoint

from ..schema import events as ev
from ..schema.sample import Columns, Sample
from ..state.fingerprint import state_leaves
from ..state.seeding import seed_globals
from ..state.stage_recorder import StageRecorder
from ..state.stages import combine
from . import algorithms, overlong
from .core import Core
from .inputs import StepInputs
from .scoring import needs_reference
from .workers import Batch, CriticWorker, collate, shard_batch

AllSum = Callable[[torch.Tensor], torch.Tensor] | None  # a sum over the data-parallel ranks (global token means), or none


class Trained(Core, Protocol):
    """What `apply` reads of the trainer (rl.trainer conforms)."""

    keep_stages: bool

    @property
    def critic(self) -> CriticWorker | None: ...

    def engines(self) -> dict: ...

    def state_fingerprint(self) -> tuple[str, dict[str, str]]: ...



@dataclass
class StepOutcome:
    metrics: dict[str, float]
    fingerprint: str
    parts: dict[str, str]
    stages: dict = field(default_factory=dict)  # {"digests": {stage: hex}, "summary": {stage: {n, mean, absmax}}} (state.stages)
    kept: dict | None = None  # with Trainer.keep_stages: {stage: [(name, host array)]}, this rank's (never journaled)

    def events(self) -> list[dict]:
        return [ev.Metrics(self.metrics).to_event(), ev.State(self.fingerprint, self.parts).to_event(), ev.Stages(**self.stages).to_event()]


class StepBook:
    """A step's bookkeeping in `Trainer.apply`: its metrics and timings, and its stage outputs
    (state.stages: what `verlj rerun` and `diff` compare) with the time spent digesting them."""

    def __init__(self, keep_stages: bool):
        self.metrics: dict[str, float] = {}
        self.timings: dict[str, float] = {}
        self.rec = StageRecorder(keep=keep_stages)  # each stage's output, digested
        self.stage_s = 0.0

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """The block's wall time, as the timing metric `name`."""
        t = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - t

    @contextmanager
    def staging(self) -> Iterator[StageRecorder]:
        """The stage recorder, the block's time counted as digesting stages (timing_s/stages)."""
        t = time.perf_counter()
        yield self.rec
        self.stage_s += time.perf_counter() - t

    def digested(self, seconds: float) -> None:
        """Time spent digesting stages elsewhere (a worker's gradients, inside its update), counted as timing_s/stages."""
        self.stage_s += seconds


def apply(tr: Trained, step: int, inputs: StepInputs, samples: list[Sample]) -> StepOutcome:
    """The deterministic half of a step: from the consumed samples (`take`), the old and reference
    log-probs, advantages (and values and returns for PPO), the DeepSpeed updates of the actor (and
    critic), the metrics and the fingerprint of the state after. The same code serves live
    training and replay, which feeds it journaled inputs: the same inputs give the same bits.
    Collective."""
    seed_globals(inputs.seeds[ev.Stream.TRAIN])  # nothing should draw from them, but if it does it is seeded
    book = StepBook(tr.keep_stages)
    scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
    book.metrics.update(_sample_metrics(samples, scores))
    _record_inputs(tr, book, inputs, samples, scores)
    if samples:
        _update(tr, step, inputs, samples, scores, book)
    else:  # dynamic sampling found no group with varying rewards: no update this step
        book.metrics.update({"actor/skipped_update": 1.0})
    return _outcome(tr, book)


def _update(tr: Trained, step: int, inputs: StepInputs, samples: list[Sample], scores: torch.Tensor, book: StepBook) -> None:
    """The step's update, top to bottom: this rank's share of the samples, the log-probs of the
    policy the step starts from (and the reference's), the advantages, the critic's update (PPO),
    the actor's; then the metrics averaged over the ranks. Collective."""
    cfg, rt = tr.cfg, tr.rt
    global_tokens = cfg.algorithm.loss_normalization == "global_tokens"
    rows, minis = shard_batch(samples, cfg.model.actor.mini_batch_size, rt.dp_size, rt.dp_rank, global_tokens)
    mine = [samples[i] for i in rows]
    all_sum = rt.dp_sum if global_tokens and rt.dp_size > 1 else None  # token means over every rank's tokens
    batch = collate(mine, tr.tokenizer.pad_token_id, rt.device)
    for i in overlong.masked(mine, cfg.rollout, tr.tokenizer.eos_token_id):  # DAPO's overlong filtering: out of the loss,
        batch.resp_mask[i] = 0.0  # its score still in its group's statistics (the advantages read every sample's score)
    mask = batch.resp_mask
    # GRPO with one pass over one mini-batch: the policy before the update is the one the
    # update's own forward sees, so the "old" log-probs come from that forward (detached)
    fuse_old = cfg.algorithm.name in ("grpo", "rloo") and cfg.model.actor.ppo_epochs == 1 and len(minis) == 1
    with book.timed("timing_s/old_log_prob"):
        old_lp = None if fuse_old else tr.actor.logprobs(batch)
    ref_lp = _ref_logprobs(tr, mine, mask.shape[1]) if needs_reference(tr.cfg) else None
    with book.timed("timing_s/adv"):
        advantages, values, returns = _advantages(tr, samples, rows, batch, scores, old_lp, ref_lp, all_sum, book)
    gen_lp = _padded(mine, "gen_logprobs", mask.shape[1], rt.device)
    if tr.critic is not None:
        with book.timed("timing_s/update_critic"):
            book.metrics.update(tr.critic.update(batch, values, returns, minis, cfg.model.actor.ppo_epochs))
    async_mode = cfg.rollout.mode == "async"
    # async rollout, and a what-if whose policy is no longer the one that generated: the off-policy correction
    correct = async_mode or inputs.rollout.whatif_correction
    with book.timed("timing_s/update_actor"):
        actor_metrics, before = tr.actor.update(batch, advantages, old_lp, ref_lp, minis, gen_lp if correct else None,
                                                  cfg.algorithm.rollout_is_threshold)
        _record_update(tr, book, mask, before, ref_lp, values, returns, advantages)
        if async_mode:
            book.metrics.update(_off_policy_metrics(tr, step, samples, before, gen_lp, mask, all_sum))
            if cfg.rollout.partial:  # generations continued across updates: each token's own version
                book.metrics.update(_token_staleness(tr, step, mine, mask, all_sum))
        if inputs.rollout.whatif:
            book.metrics.update(_drift_metrics(tr, before, gen_lp, mask, all_sum, correct))
        book.metrics.update(actor_metrics)
    book.metrics.update(_logprob_gap(tr, step, inputs, mine, gen_lp, before, mask, all_sum))
    book.metrics = rt.mean(book.metrics)
    act = failpoint("update.params")
    if act is not None and act.startswith("flip="):  # fault injection: silent corruption of the weights
        tr.actor.flip_a_weight_bit(act)


def _ref_logprobs(tr: Trained, mine: list[Sample], width: int) -> torch.Tensor:
    """The frozen reference's log-probs of this rank's rows ([B, R]), as journaled with the samples."""
    # samples from before a config change that turned the KL on have none journaled
    tr.scorer.reference_logprobs([s for s in mine if len(s.ref_logprobs) != len(s.response_ids)], tr.actor)
    return _padded(mine, "ref_logprobs", width, tr.rt.device)


def _advantages(tr: Trained, samples: list[Sample], rows: list[int], batch: Batch, scores: torch.Tensor,
                old_lp: torch.Tensor | None, ref_lp: torch.Tensor | None, all_sum: AllSum, book: StepBook) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's advantages ([B, R]), by the algorithm's rule (rl.algorithms); PPO's also the
    critic's values before the update and the returns (the others: None, None)."""
    cfg, mask = tr.cfg, batch.resp_mask
    values = returns = None
    if cfg.algorithm.name in ("grpo", "rloo"):
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        advantages = (algorithms.grpo_token_advantages(scores, groups, rows, mask, cfg.algorithm.norm_adv_by_std)
                      if cfg.algorithm.name == "grpo" else algorithms.rloo_token_advantages(scores, groups, rows, mask))
    elif cfg.algorithm.name == "reinforce_plus_plus":
        advantages = algorithms.reinforce_pp_advantages(scores[rows].to(tr.rt.device), mask, old_lp, ref_lp,
                                                        cfg.algorithm.kl_coef, cfg.algorithm.gamma, all_sum)
    else:
        assert tr.critic is not None, "PPO trains a critic"
        with book.timed("timing_s/values"):
            values = tr.critic.values(batch)
        advantages, returns = algorithms.ppo_advantages(scores[rows].to(tr.rt.device), values, mask, old_lp, ref_lp,
                                                        cfg.algorithm.kl_coef, cfg.algorithm.gamma, cfg.algorithm.lam, all_sum)
        book.metrics.update({"critic/values/mean": algorithms.global_masked_mean(values, mask, all_sum).item(),
                             "critic/returns/mean": algorithms.global_masked_mean(returns, mask, all_sum).item()})
    book.metrics.update({"critic/advantages/mean": algorithms.global_masked_mean(advantages, mask, all_sum).item()})
    return advantages, values, returns


def _logprob_gap(tr: Trained, step: int, inputs: StepInputs, mine: list[Sample], gen_lp: torch.Tensor, before: torch.Tensor,
                 mask: torch.Tensor, all_sum: AllSum) -> dict[str, float]:
    """The engine against the trainer, on the samples generated by the policy the step starts from
    (sync: this step's; carried-over groups and async's stale samples came from an older policy):
    0 when there are none (algorithms.logprob_gap)."""
    rt = tr.rt
    if tr.cfg.rollout.partial:  # each token by the version that generated it (a generation continued across updates)
        now = (_token_versions(mine, mask.shape[1], rt.device) == step - 1).float() * mask
        return algorithms.logprob_gap(gen_lp, before, now, all_sum, rt.max_over if rt.dp_size > 1 else None)
    if tr.cfg.rollout.mode == "async":
        now_rows = [float(s.policy_version == step - 1) for s in mine]
    else:
        fresh = set(Columns(inputs.added).ids.tolist())
        now_rows = [float(s.id in fresh) for s in mine]
    now = torch.tensor(now_rows, device=rt.device)[:, None] * mask
    return algorithms.logprob_gap(gen_lp, before, now, all_sum, rt.max_over if rt.dp_size > 1 else None)


def _token_versions(samples: list[Sample], width: int, device: Any) -> torch.Tensor:
    """Each response token's policy version ([B, R], int64; -1 past a response's end): its sample's runs (schema.sample)."""
    out = torch.full((len(samples), width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        versions = s.token_versions()
        out[i, : len(versions)] = torch.from_numpy(versions)
    return out.to(device)


def _token_staleness(tr: Trained, step: int, mine: list[Sample], mask: torch.Tensor, all_sum: AllSum) -> dict[str, float]:
    """rollout.partial: how many versions each trained token lags the policy the step starts from (step - 1 minus
    the version that generated it), mean over every rank's tokens and max; the share of tokens generated by
    another version than their sample's oldest (their generation went on across an update)."""
    rt = tr.rt
    versions = _token_versions(mine, mask.shape[1], rt.device)
    lag = (step - 1 - versions).float() * mask
    oldest = torch.tensor([s.policy_version for s in mine], dtype=torch.long, device=rt.device)[:, None]
    top = lag.max() if lag.numel() else torch.zeros((), device=mask.device)
    return {"rollout/token_staleness/mean": algorithms.global_masked_mean(lag, mask, all_sum).item(),
            "rollout/token_staleness/max": (rt.max_over(top) if rt.dp_size > 1 else top).item(),
            "rollout/partial/later_version_tokens": algorithms.global_masked_mean((versions != oldest).float(), mask, all_sum).item()}

# ------------------------------------------------------------------ apply's bookkeeping: stages, fingerprint


def _record_inputs(tr: Trained, book: StepBook, inputs: StepInputs, samples: list[Sample], scores: torch.Tensor) -> None:
    """The stages the update starts from: the ids it trains on, their dataset rows and tokens, the scores."""
    with book.staging() as rec:
        # what the update trains on: the ids consumed and their dataset rows (async: drawn steps before)
        rec.host("data", np.asarray(inputs.consumed, np.int64), np.asarray([s.index for s in samples], np.int64))
        rec.host("samples", *_id_arrays(samples))
        rec.tensor("scores", scores)


def _record_update(tr: Trained, book: StepBook, mask: torch.Tensor, before: torch.Tensor, ref_lp: torch.Tensor | None,
                   values: torch.Tensor | None, returns: torch.Tensor | None, advantages: torch.Tensor) -> None:
    """The update's stages: what it started from (log-probs, values, returns, advantages), and each
    worker's losses, gradient norms and gradients (digested inside the update)."""
    with book.staging() as rec:
        rec.tensor("old_logprobs", before * mask, mask)
        if ref_lp is not None:
            rec.tensor("ref_logprobs", ref_lp * mask, mask)
        if tr.critic is not None:
            assert values is not None and returns is not None, "PPO's advantages come with values and returns"
            rec.tensor("values", values * mask, mask)
            rec.tensor("returns", returns * mask, mask)
        rec.tensor("advantages", advantages, mask)
        for worker in (tr.critic, tr.actor):
            if worker is not None:
                losses, norms, grads, grad_s, kept = worker.stage_outputs()
                book.digested(grad_s)  # digested inside the update (its time counts there too)
                rec.tensor("loss", torch.cat(losses))
                rec.numbers("grad_norm", norms)
                for g in grads:
                    if g is not None:
                        rec.digest_only("grads", g)
                for k, step_grads in enumerate(kept):
                    for j, g in enumerate(step_grads):
                        rec.keep("grads", f"{worker.role} optimizer step {k}, gradient {j}", g)


def _outcome(tr: Trained, book: StepBook) -> StepOutcome:
    """The step's outcome: its metrics and timings, the fingerprint of the state after it, and the
    stage digests of every rank combined (with the state's parts). Collective."""
    with book.timed("timing_s/fingerprint"):
        fp, parts = tr.state_fingerprint()
    if tr.keep_stages:
        for role, engine in tr.engines().items():
            for path, leaf in state_leaves(engine):
                if isinstance(leaf, torch.Tensor):
                    book.rec.keep("state", f"{role}/{path}", leaf)
    with book.staging() as rec:
        stages = combine(tr.rt.all_gather_obj(rec.local()), parts)
    book.timings.update({"timing_s/stages": book.stage_s})
    return StepOutcome({**book.metrics, **book.timings}, fp, parts, stages, book.rec.kept)


def _off_policy_metrics(tr: Trained, step: int, samples: list[Sample], old_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor,
                        all_sum: AllSum) -> dict[str, float]:
    """Async rollout: the truncated importance weights min(pi_old / pi_gen, threshold) the update
    used, where pi_old is the policy this step starts from (the clipped ratio's denominator) and
    pi_gen the generator's (journaled with the sample); and the staleness of the step's samples."""
    rt, threshold = tr.rt, tr.cfg.algorithm.rollout_is_threshold
    weights, raw = algorithms.truncated_is_weights(old_lp, gen_lp, mask, threshold)
    top = raw.max() if raw.numel() else torch.zeros((), device=raw.device)
    staleness = np.array([step - 1 - s.policy_version for s in samples], dtype=np.float64)
    return {
        "rollout/is_weight/mean": algorithms.global_masked_mean(weights, mask, all_sum).item(),
        "rollout/is_weight/max": (rt.max_over(top) if rt.dp_size > 1 else top).item(),
        "rollout/is_truncated": algorithms.global_masked_mean((raw > threshold).float(), mask, all_sum).item(),
        "rollout/staleness/mean": float(staleness.mean()),
        "rollout/staleness/max": float(staleness.max()),
    }


def _drift_metrics(tr: Trained, old_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor, all_sum: AllSum,
                   corrected: bool) -> dict[str, float]:
    """A what-if's step: how far the policy it starts from (pi_whatif) has moved from the one that
    generated its samples (pi_gen, journaled with them), over the response tokens: |log pi_whatif -
    log pi_gen|, mean and max; the importance weights min(pi_whatif / pi_gen, threshold), their
    mean and max, and the share of tokens past the threshold; whether the update applied them."""
    rt, threshold = tr.rt, tr.cfg.algorithm.rollout_is_threshold
    zero = torch.zeros((), device=mask.device)
    gap = (old_lp - gen_lp).abs() * mask
    weights, raw = algorithms.truncated_is_weights(old_lp, gen_lp, mask, threshold)
    top = lambda t: (rt.max_over(t.max() if t.numel() else zero) if rt.dp_size > 1 else (t.max() if t.numel() else zero)).item()
    return {
        "whatif/drift/mean": algorithms.global_masked_mean(gap, mask, all_sum).item(),
        "whatif/drift/max": top(gap),
        "whatif/is_weight/mean": algorithms.global_masked_mean(weights, mask, all_sum).item(),
        "whatif/is_weight/max": top(raw),
        "whatif/is_clipped_frac": algorithms.global_masked_mean((raw > threshold).float(), mask, all_sum).item(),
        "whatif/off_policy_correction": float(corrected),
    }


def _id_arrays(samples: list[Sample]) -> tuple[np.ndarray, ...]:
    """The consumed samples' ids, prompt and response token ids and their lengths, as flat arrays."""
    ids = np.asarray([s.id for s in samples], np.int64)
    lens = np.asarray([[len(s.prompt_ids), len(s.response_ids)] for s in samples], np.int64).reshape(-1, 2)
    flat = [np.asarray(x, np.int64) for s in samples for x in (s.prompt_ids, s.response_ids)]
    return ids, lens, np.concatenate(flat) if flat else np.zeros(0, np.int64)


def _padded(samples: list[Sample], key: str, width: int, device: Any) -> torch.Tensor:
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, s in enumerate(samples):
        values = getattr(s, key)
        out[i, : len(values)] = torch.from_numpy(values)
    return out.to(device)


def _sample_metrics(samples: list[Sample], scores: torch.Tensor) -> dict[str, float]:
    if not samples:
        return {"batch/samples": 0.0}
    resp = np.array([len(s.response_ids) for s in samples], dtype=np.float64)
    prm = np.array([len(s.prompt_ids) for s in samples], dtype=np.float64)
    rule = np.array([s.rule_reward for s in samples], dtype=np.float64)
    return {
        "critic/score/mean": float(scores.double().mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(rule.mean()),
        "response_length/mean": float(resp.mean()),
        "response_length/max": float(resp.max()),
        "prompt_length/mean": float(prm.mean()),
        "batch/samples": float(len(samples)),
    }

