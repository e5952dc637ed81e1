"""Samples that hit the length limit, handled as RL trainers handle over-long answers (rollout.overlong).

    rollout.overlong: keep | mask | reward | penalty     # keep: today's (scored and trained as any sample)
    rollout.overlong_reward: 0.0                         # reward: their score
    rollout.overlong_buffer: 0                           # penalty: the tokens before the limit where it grows
    rollout.overlong_penalty: 1.0                        # penalty: what a sample at the limit loses

A sample is **truncated** (:func:`truncated`) when its generation was cut by a limit rather than ended by the
policy: a single-turn response that ends without the end-of-sequence token (it reached rollout.max_response_length:
verlj's sampler and vLLM stop only at the end token or there), an episode whose context left no room for another
action (``EnvEnd.LENGTH``: rollout.max_episode_length), an agent episode whose last answer was cut at its length
(``EnvEnd.LENGTH``, set where its episode is played: the agent then raised, as the OpenAI Agents SDK does on an
``incomplete`` response, or returned). A truncated sample is never a fault: its tokens are what the policy wrote,
and how long it writes is what the update must learn about.

- ``mask``: DAPO's overlong filtering (Yu et al. 2025, section 3.4): out of the loss, its score still in its
  group's statistics. Decided in the update from the sample and the config in force (:func:`masked`), so a
  replay, a rerun and a what-if decide it alike.
- ``reward``: its score is rollout.overlong_reward (the reward function's value stays in ``rule_reward``).
- ``penalty``: DAPO's soft overlong punishment, R = -p * (L - (Lmax - B)) / B for a last generation of L tokens
  within the last B = rollout.overlong_buffer tokens below Lmax = rollout.max_response_length, added to every
  sample's score; a truncated sample loses all of p (DAPO's L > Lmax). A sample's last generation is its response
  (single-turn) or its last action (an episode's, an agent's last trained call).

``reward`` and ``penalty`` change the score where the samples are scored (:func:`shape`), before dynamic sampling
and the journal, so replay reads them back as it reads any score.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..schema.sample import EnvEnd, Sample

if TYPE_CHECKING:
    from ..config import RolloutConfig


def truncated(s: Sample, eos: int | None) -> bool:
    """Whether `s` hit the length limit (see the module's doc). `eos`: the tokenizer's end-of-sequence id."""
    if s.is_episode:
        return s.env_end == EnvEnd.LENGTH
    return len(s.response_ids) > 0 and (eos is None or int(s.response_ids[-1]) != eos)


def last_generation(s: Sample) -> int:
    """The tokens of the sample's last generation: its response, or an episode's last action."""
    if not s.is_episode:
        return len(s.response_ids)
    lens = np.asarray(s.turn_lens, np.int64).reshape(-1, 2)
    return int(lens[-1, 0]) if len(lens) else 0


def shape(samples: list[Sample], ro: RolloutConfig, eos: int | None) -> None:
    """rollout.overlong reward or penalty on the scores of newly scored `samples` (in place); a faulted sample, which
    scores nothing real and is never trained, is left as it is."""
    if ro.overlong not in ("reward", "penalty"):
        return
    for s in samples:
        if s.fault_reason:
            continue
        cut = truncated(s, eos)
        if ro.overlong == "reward":
            if cut:
                s.score = float(ro.overlong_reward)
            continue
        start = ro.max_response_length - ro.overlong_buffer
        over = ro.overlong_buffer if cut else min(max(0, last_generation(s) - start), ro.overlong_buffer)
        if over:
            s.score = s.score - ro.overlong_penalty * over / ro.overlong_buffer


def masked(samples: list[Sample], ro: RolloutConfig, eos: int | None) -> list[int]:
    """rollout.overlong=mask: the positions among `samples` whose loss the update masks (the truncated ones); [] else."""
    if ro.overlong != "mask":
        return []
    return [i for i, s in enumerate(samples) if truncated(s, eos)]


def metrics(samples: list[Sample], eos: int | None) -> dict[str, float]:
    """rollout/truncated: how many of the step's generated samples hit the length limit (faults aside)."""
    return {"rollout/truncated": float(sum(truncated(s, eos) for s in samples if not s.fault_reason))}
