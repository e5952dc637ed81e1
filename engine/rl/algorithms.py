"""GRPO, RLOO, REINFORCE++ and PPO math: advantages, losses, KL. Pure tensor functions, tested
against hand-computed values.

Shapes: ``[B, R]`` per response token with a 0/1 ``mask`` of the same shape; ``[B]`` per sample.
Aggregation is verl's ``loss_agg_mode`` (:func:`agg_loss`; token-mean by default). The losses take
an optional ``denom``: the token count to divide by when a micro-batch is one share of a larger
mini-batch (``algorithm.loss_normalization=global_tokens``, see ``workers.shard_batch``); without
it, the micro-batch's own token count. The sequence-level modes take ``seqs`` likewise: the
mini-batch's number of samples over all ranks (without it, the micro-batch's own rows).

Departures from the papers, on purpose:
- GRPO (DeepSeekMath): the KL term is the k3 estimator ``exp(ref - lp) - (ref - lp) - 1`` (as
  there), added to the loss rather than the reward; std-normalisation can be turned off
  (``algorithm.norm_adv_by_std``, Dr. GRPO style).
- PPO (Ouyang et al.): the KL-to-reference penalty is folded into the token rewards with a fixed
  coefficient (no adaptive controller); the score lands on the last response token.
- RLOO (Ahmadian et al. 2024, verl's ``compute_rloo_outcome_advantage``): a lone sample in its
  group keeps its score as its advantage, as in verl.
- REINFORCE++ (Hu 2025, verl's ``compute_reinforce_plus_plus_outcome_advantage``): the returns are
  whitened with the biased variance (verlj's :func:`whiten`, as PPO's), verl's with the unbiased one;
  an episode's observation tokens are skipped by the discounted return, as by :func:`gae`.
- GSPO (Zheng et al. 2025, GSPO-token as verl's ``loss_mode=gspo``): the sequence ratio is aggregated
  by ``loss_agg_mode`` like any loss (verl's GSPO recipe sets ``seq-mean-token-mean``).
- Dr. GRPO's ``seq-mean-token-sum-norm`` divides by the samples times ``rollout.max_response_length``
  (TRL's ``loss_type=dr_grpo``), a constant, where verl divides by the batch's padded width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-6
ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "ppo")  # algorithm.name: how advantages are estimated
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_MODES = ("vanilla", "gspo")  # model.actor.loss_mode: token ratios (PPO's clip) | GSPO's sequence ratio


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom=None) -> torch.Tensor:
    return (x * mask).sum() / (mask.sum().clamp(min=1) if denom is None else denom)


def agg_loss(x: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", denom=None, seqs=None, norm_len=None) -> torch.Tensor:
    """A [B, R] per-token loss to a scalar, as verl's ``agg_loss``: token-mean (over every token:
    `denom`), seq-mean-token-sum (each sample's token sum, averaged over the samples: `seqs`),
    seq-mean-token-mean (each sample's token mean, averaged over the samples) or
    seq-mean-token-sum-norm (Dr. GRPO: the token sum over `seqs` times the constant `norm_len`).
    `denom` and `seqs` are the whole mini-batch's counts on every rank; None: this micro-batch's."""
    if mode == "token-mean":
        return masked_mean(x, mask, denom)
    n = x.shape[0] if seqs is None else seqs
    per_seq = (x * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(n, 1)
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=-1).clamp(min=1)).sum() / max(n, 1)
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / (max(n, 1) * norm_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


@dataclass(frozen=True)
class Aggregation:
    """:func:`agg_loss`'s mode and sample counts for one micro-batch (algorithm.loss_agg_mode)."""

    mode: str = "token-mean"
    seqs: int | None = None  # the mini-batch's samples on every rank (None: this micro-batch's)
    norm_len: float | None = None  # seq-mean-token-sum-norm's constant length

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, denom=None) -> torch.Tensor:
        return agg_loss(x, mask, self.mode, denom, self.seqs, self.norm_len)


def grpo_advantages(scores: torch.Tensor, groups: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """Per-sample advantage: score minus its group's mean, over the group's (unbiased) std if asked."""
    adv = torch.empty_like(scores)
    for g in torch.unique(groups):
        idx = groups == g
        s = scores[idx]
        centred = s - s.mean()
        if norm_by_std:
            std = s.std(unbiased=True) if s.numel() > 1 else torch.zeros((), dtype=s.dtype)
            centred = centred / (std + EPS)
        adv[idx] = centred
    return adv


def rloo_advantages(scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample RLOO advantage: score minus the mean of the other samples of its group,
    ``n/(n-1) * (score - group mean)`` (verl's form); a group of one keeps its score. `valid` ([N]
    bool): samples left out of every group's statistics, with advantage 0."""
    adv = torch.zeros_like(scores)
    ok = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    for g in torch.unique(groups):
        idx = (groups == g) & ok
        s = scores[idx]
        n = s.numel()
        if n == 1:
            adv[idx] = s
        elif n > 1:
            adv[idx] = s * (n / (n - 1)) - s.mean() * (n / (n - 1))
    return adv


def rloo_token_advantages(scores: torch.Tensor, groups: torch.Tensor, rows, mask: torch.Tensor) -> torch.Tensor:
    """RLOO's advantages, [B, R], for this rank's `rows` of the step's samples (as
    grpo_token_advantages)."""
    return rloo_advantages(scores, groups)[rows].to(mask.device)[:, None] * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE's returns, [B, R]: each policy token's reward plus gamma times the next policy
    token's return (an episode's observation tokens are skipped, as in gae); 0 off the mask."""
    B, R = rewards.shape
    out = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(R)):
        policy = mask[:, t] > 0
        running = torch.where(policy, rewards[:, t] + gamma * running, running)
        out[:, t] = running * mask[:, t]
    return out


def reinforce_pp_advantages(scores: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor | None,
                            ref_logprobs: torch.Tensor | None, kl_coef: float, gamma: float, all_sum=None) -> torch.Tensor:
    """REINFORCE++'s advantages, [B, R]: the token rewards (as PPO's: the [B] score on the last
    response token, minus kl_coef times the k3 KL to the reference per token when `ref_logprobs`),
    their discounted returns, whitened over every rank's tokens (`all_sum`). No critic, no groups."""
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None and logprobs is not None else None
    returns = discounted_returns(token_rewards(scores, mask, kl, kl_coef), mask, gamma)
    return whiten(returns, mask, all_sum)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's low-variance unbiased KL(pi || ref) estimator, per token."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(d) - d - 1


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """PPO: -kl_coef * kl per token, plus the sequence score on the last response token."""
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    # the last policy token (an episode's mask has holes at observation tokens: rl.episodes)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values if mask.shape[1] else mask.sum(dim=1).long() - 1
    rows = torch.arange(mask.shape[0])
    has = last >= 0
    rewards[rows[has], last[has]] += scores[has]
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens. Returns (advantages, returns), both [B, R].
    A mask with holes (an episode's observation tokens) skips them: the next value and the running
    advantage carry over them from the next policy token, as if the observation were not there."""
    if mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        return _gae_skipping(rewards, values, mask, gamma, lam)
    B, R = rewards.shape
    adv = torch.zeros_like(rewards)
    last_gae = torch.zeros(B, dtype=rewards.dtype)
    for t in reversed(range(R)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < R else torch.zeros(B, dtype=values.dtype)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae * (mask[:, t + 1] if t + 1 < R else 0.0)
        adv[:, t] = last_gae * mask[:, t]
    returns = (adv + values) * mask
    return adv, returns


def _gae_skipping(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    B, R = rewards.shape
    adv = torch.zeros_like(rewards)
    last_gae = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(R)):
        policy = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * last_gae
        adv[:, t] = step * mask[:, t]
        last_gae = torch.where(policy, step, last_gae)
        next_value = torch.where(policy, values[:, t], next_value)
    returns = (adv + values) * mask
    return adv, returns


def grpo_token_advantages(scores: torch.Tensor, groups: torch.Tensor, rows, mask: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO's advantages, [B, R]: each sample's group-normalised score (`grpo_advantages` over the
    step's samples, [N] each, every rank's) on each of its response tokens, for the rows `rows` of
    them this rank trains on (the [B, R] `mask`'s rows)."""
    adv = grpo_advantages(scores, groups, norm_by_std)
    return adv[rows].to(mask.device)[:, None] * mask


def ppo_advantages(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor,
                   ref_logprobs: torch.Tensor | None, kl_coef: float, gamma: float, lam: float, all_sum=None):
    """PPO's advantages and returns, [B, R] each: the token rewards (the [B] score on the last
    response token, minus kl_coef times the k3 KL to the reference per token when `ref_logprobs`),
    GAE over the critic's `values`, then the advantages whitened over every rank's tokens (`all_sum`)."""
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else None
    rewards = token_rewards(scores, mask, kl, kl_coef)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    return whiten(advantages, mask, all_sum), returns


def whiten(x: torch.Tensor, mask: torch.Tensor, all_sum=None) -> torch.Tensor:
    """Zero mean, unit variance over the masked tokens; over every data-parallel rank's tokens when
    `all_sum` (a sum across ranks) is given."""
    mean = global_masked_mean(x, mask, all_sum)
    var = global_masked_mean((x - mean) ** 2, mask, all_sum)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def global_masked_mean(x: torch.Tensor, mask: torch.Tensor, all_sum=None) -> torch.Tensor:
    """masked_mean over the tokens of every rank (`all_sum` sums a tensor across ranks); without
    `all_sum`, the same bits as masked_mean."""
    if all_sum is None:
        return masked_mean(x, mask)
    total, count = all_sum(torch.stack([(x * mask).sum(), mask.sum()]))
    return total / count.clamp(min=1)


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_ratio: float, denom=None, token_weights=None, *,
                clip_ratio_high: float | None = None, loss_mode: str = "vanilla", agg: str = "token-mean", seqs=None,
                norm_len=None):
    """Clipped surrogate. Returns (loss, clipfrac, approx_kl): the loss aggregated by `agg`
    (:func:`agg_loss`), the two metrics token means. The ratio is clipped to
    [1 - clip_ratio, 1 + clip_ratio_high] (DAPO's clip-higher; clip_ratio_high None: clip_ratio).
    ``loss_mode``: vanilla (each token's ratio) | gspo (GSPO-token: each token's ratio is its
    sequence's, exp of the mean log-ratio over its tokens, with each token's own gradient).
    ``token_weights``: each token's loss times its (detached) importance weight (async rollout)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)
    if loss_mode == "gspo":
        seq = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        ratio = torch.exp((logprobs - logprobs.detach() + seq.detach()[:, None]).clamp(max=10.0))
    else:
        ratio = torch.exp(log_ratio)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = agg_loss(per_token, mask, agg, denom, seqs, norm_len)
    clipfrac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask, denom)
    approx_kl = masked_mean(-log_ratio, mask, denom)
    return loss, clipfrac, approx_kl


def truncated_is_weights(old_logprobs, gen_logprobs, mask, threshold: float):
    """Async rollout's correction: each token's importance weight pi_old / pi_gen, truncated at
    `threshold` (verl's rollout correction, TIS). Returns (weights, untruncated), both 0 off the mask."""
    raw = torch.exp((old_logprobs - gen_logprobs).clamp(-20, 20)) * mask
    return raw.clamp(max=threshold), raw


def value_loss(values, old_values, returns, mask, cliprange: float, denom=None):
    """Clipped value loss, 0.5 * max((v - R)^2, (v_clip - R)^2). Returns (loss, clipfrac)."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange, cliprange)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(l1, l2), mask, denom)
    clipfrac = masked_mean((l2 > l1).to(values.dtype), mask, denom)
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprob_gap(gen_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, all_sum=None, all_max=None) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's for the
    same tokens (before the update), over every response token of the step (verl's rollout/actor
    probability difference): mean and max of |Δ log p| and of |Δ p|. ``all_max`` is the maximum over
    ranks, as ``all_sum`` is the sum."""
    out = {}
    for name, diff in (("logprob_diff", gen_logprobs - logprobs), ("probs_diff", gen_logprobs.exp() - logprobs.exp())):
        d = diff.abs() * mask
        top = d.max() if d.numel() else torch.zeros((), dtype=d.dtype, device=d.device)
        out[f"rollout/{name}/mean"] = global_masked_mean(d, mask, all_sum).item()
        out[f"rollout/{name}/max"] = (all_max(top) if all_max is not None else top).item()
    return out
