"""Faults in the rollout: samples that an environment or a reward function failed, never trained on.

    rollout.max_fault_rate: 0.5     # a step where more than this share of its samples ended by a fault stops the run

A sample's fault (``Sample.fault_reason``): its episode's env raised, returned something that is no
answer or hung (``env_end`` FAULT, ``env_reason``; rl.envs), or its reward function raised or returned
a non-finite number (``fault``; rl.rewards.scored_or_faults). Such a sample scores nothing real: it is
journaled with its reason, counted, and left out of the update (:func:`excluded`): out of the loss and
out of its group's GRPO statistics, and a GRPO group left with fewer than two samples is left out
whole. What is left out is a buffer.drop of reason ``fault`` in the step's record, decided from the
journaled samples alone when they are generated, so replay reads it back as it reads any drop.

Every step says how many of the samples it generated ended by a fault and the first one's reason
(:func:`metrics`, :func:`note`: the step's log line); past rollout.max_fault_rate the step is not
committed and the run stops in one line (:func:`check`), to go on exactly with ``--resume`` once the
fault is fixed (the step's samples are generated again from their own seeds).
"""

from __future__ import annotations

from collections import Counter

from ..errors import RunError
from ..schema.sample import EnvEnd, Sample

NONE, ENV, REWARD = "", "env", "reward"  # what ended a sample (kind)
# the step's metrics (`metrics`); UNRESOLVED: its episodes that ended unresolved, among its env faults (rl.gateway.runner counts them)
FAULTS, ENV_FAULTS, REWARD_FAULTS, UNRESOLVED = "rollout/faults", "rollout/faults/env", "rollout/faults/reward", "agent/unresolved"


def kind(s: Sample) -> str:
    """What ended a faulted sample: ENV (its env) or REWARD (its reward function); NONE ("") when none did."""
    if s.env_end in (EnvEnd.FAULT, EnvEnd.UNRESOLVED):  # unresolved: an episode's outcome unknown (rl.gateway.tools)
        return ENV
    return REWARD if s.fault else NONE


def excluded(samples: list[Sample], min_group: int) -> list[int]:
    """The ids out of the update among a batch of new `samples` (ids and groups set): every faulted
    sample, and every sample of a group left with fewer than `min_group` samples without a fault
    (GRPO: 2, or the group size when it is 1; PPO: 1). Ids in the samples' order."""
    healthy = Counter(int(s.group) for s in samples if not s.fault_reason)
    return [int(s.id) for s in samples if s.fault_reason or healthy[int(s.group)] < min_group]


def min_group(algorithm: str, group_size: int) -> int:
    """The fewest samples without a fault a group keeps to be trained on: GRPO needs two to compare."""
    return min(2, group_size) if algorithm == "grpo" else 1


def metrics(samples: list[Sample]) -> dict[str, float]:
    """The step's samples generated (all rounds), how many ended by a fault, by kind: rollout/faults,
    rollout/faults/env, rollout/faults/reward, rollout/fault_rate (0 when none was generated)."""
    kinds = Counter(kind(s) for s in samples)
    n = len(samples) - kinds[NONE]
    return {FAULTS: float(n), ENV_FAULTS: float(kinds[ENV]), REWARD_FAULTS: float(kinds[REWARD]),
            "rollout/fault_rate": n / len(samples) if samples else 0.0}


def note(samples: list[Sample]) -> str:
    """The step's faults for its log line: ``faults 3/16: step raised RuntimeError: the sandbox is down``
    (the first faulted sample's reason, in id order); ``faults 0/16`` for episodes (environments and
    agents) without one; "" for single-turn samples without one, or without samples."""
    faulted = sorted((s for s in samples if s.fault_reason), key=lambda s: s.id)
    if not faulted and not any(s.is_episode for s in samples):
        return ""
    head = f"faults {len(faulted)}/{len(samples)}"
    return f"{head}: {faulted[0].fault_reason}" if faulted else head


class FaultStop(RunError):
    """A step stopped by its faults (past rollout.max_fault_rate): nothing of it was committed. `summary`: what
    ended which samples, in one sentence; `advice`: how to go on (:func:`check` says it for a run that is kept;
    loop.run says otherwise where a fresh run's first step stopped and nothing of the run was kept)."""

    def __init__(self, step: int, summary: str, advice: str):
        self.step, self.summary = step, summary
        super().__init__(f"{summary}. {advice}")


def check(step: int, samples: list[Sample], max_rate: float, run_dir) -> None:
    """A FaultStop (exit 1, one line) when more than `max_rate` of the step's samples ended by a fault:
    the step is not committed. The line names the commonest reasons and how to go on."""
    faulted = [s for s in samples if s.fault_reason]
    if not samples or len(faulted) <= max_rate * len(samples):
        return
    what = "episodes" if any(s.is_episode for s in samples) else "samples"
    reasons = Counter(s.fault_reason for s in sorted(faulted, key=lambda s: s.id)).most_common()
    said = "; ".join(f"{n}× {r}" if len(reasons) > 1 else r for r, n in reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    raise FaultStop(step, f"step {step}: {len(faulted)} of {len(samples)} {what} ended by a fault, more than rollout.max_fault_rate="
                          f"{max_rate:g} allows: {said}",
                    f"Nothing of step {step} was committed; fix it and run `verlj train --output-dir {run_dir} --resume`, or resume "
                    f"with rollout.max_fault_rate=1 to train past the faults and read each one with `verlj inspect {run_dir} --step {step}`")
