"""Rollout engines: what turns prompts and one seed per sample into responses and their log-probs.

Each sample's seed comes from its place in the step (the rollout source: ``rl.sources``), not from the rank that
generates it, so the same weights give the same samples at any world size.

- ``hf`` (:class:`HFEngine`): verlj's own sampler (``rl.sampler``) on the actor's own module.
- ``vllm`` (``vllm_engine.VllmEngine``): a colocated vLLM engine, the seed being the request's.
- ``rollout.mode=async`` (``async_rollout.GeneratorProcess``): verlj's sampler (or, with
  ``rollout.engine=vllm``, a vLLM engine) in a process beside the trainer, on its own copy of the policy.
- ``rollout.fleet=ray`` (``fleet.RayFleet``): verlj's sampler (or, with ``rollout.engine=vllm``,
  ``fleet.VllmRayFleet``: a vLLM engine each) in ``rollout.fleet_size`` Ray actors.

Only live steps generate: replay reads the samples from the journal, so it never builds an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..config import Config
from .partial import Progress
from .sampler import AskedGroup, GeneratesHere, SamplerEngine, sample_seeded, sampling_params

if TYPE_CHECKING:
    from ..dist import Runtime
    from .async_rollout import GeneratorProcess, VllmGeneratorProcess
    from .fleet import RayFleet, VllmRayFleet
    from .vllm_engine import VllmEngine
    from .workers import ActorWorker


# What a `submit` hands back for `result`: the samples themselves (engines that generate at once) or a
# ticket for them (engines that generate beside the trainer). Only the engine that made one reads it.
Handle = Any



class RolloutEngine(Protocol):
    """What generates a step's samples (``rollout.engine``; :func:`make_engine` chooses, in one place):
    exactly what the rollout sources (``rl.sources``) and the loop call on one. mypy holds every engine to it (``_conforms``).

    Exactness lives in ``apply`` (``rl.update``), never here: whatever an engine returns is journaled and
    replay reads it back, so an engine may be fast and nondeterministic. Only live steps use one.
    """

    name: str  # what the journal's `rollout` event records, with `version`
    version: str  # the version of the package that generates (transformers for hf, vllm for vllm)

    @classmethod
    def preflight(cls, cfg: Config, device) -> None:
        """Before a run that will generate writes anything: raise ConfigError if it cannot run here."""

    def __init__(self, rt: Runtime, actor: ActorWorker, tokenizer) -> None:
        """Build nothing yet: an engine starts at its first `sync`."""

    def sync(self, cfg: Config, version: int) -> None:
        """Make the engine generate from the actor's current weights, policy `version` (the step whose
        update made them): start it, push them. Collective."""

    def submit(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config) -> Handle:
        """Start generating one sample per prompt, each drawn from its own seed; `result` returns them.
        An engine that runs beside the trainer (async rollout) returns at once; the others generate
        here. Collective."""

    def result(self, handle: Handle) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(response ids, their log-probs under the sampling distribution) of a `submit`, waiting for
        them. Collective."""

    def ask(self, groups: list[AskedGroup], cfg: Config, batch_groups: int, progress: dict[int, Progress] | None = None) -> None:
        """Completion order (``rollout.async_order=completion``): queue groups; they come back from
        `arrived` in the order they complete, up to `batch_groups` of them generated together.
        rollout.partial: a group in `progress` goes on from its tokens so far (rl.partial).
        Engines that generate only in step order refuse it (config.validate never lets it reach them)."""

    def arrived(self, wait: float) -> list[tuple]:
        """Completion order: the groups completed since the last call, as (group, responses, log-probs,
        version), waiting up to `wait` seconds for the first when none has; rollout.partial: with each
        sample's version runs after them (the version: the oldest token's)."""

    def partials(self) -> list[tuple]:
        """rollout.partial: the groups the pushes since the last call stopped with tokens, as (group,
        responses, log-probs, runs, done), each as it stood at its latest push. Completion order only."""

    def weights_changed(self) -> None:
        """The actor's weights changed (an update, a snapshot load): the next sync must bring them."""

    def metrics(self) -> dict[str, float]:
        """What the engine counts of itself for the step's metrics (the fleet: rollout/fleet/*; {} for the others)."""

    def close(self, at_once: bool = False) -> None:
        """Release what the engine holds (memory, threads), keeping the trainer's process group.
        `at_once`: the user asked to stop now (a second Ctrl-C): wait for no work in flight."""


class HFEngine(GeneratesHere, SamplerEngine):
    """rollout.engine=hf: sampling with the actor's own module (ZeRO-3 and TP ranks step together)."""

    def generate(self, prompts: list[np.ndarray], seeds: list[int], cfg: Config,
                 on_token: Callable[[np.ndarray], None] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`on_token`: each step's tokens as they are sampled (the agent gateway's streams: ``rl.sampler.generate``)."""
        return sample_seeded(self.actor.module, prompts, seeds, sampling_params(cfg), self.tokenizer.eos_token_id,
                             self.tokenizer.pad_token_id, self.rt.device, all_done=self.rt.all_true, on_token=on_token)

    def weights_changed(self) -> None:
        """Nothing to do: it samples from the trained module itself."""

    def sync(self, cfg: Config, version: int) -> None:
        """Nothing to do (see weights_changed)."""

    def close(self, at_once: bool = False) -> None:
        pass


def engine_class(name: str, mode: str = "sync", fleet: str = "none") -> type[RolloutEngine]:
    """The class of the engine `rollout.engine`, `rollout.mode` and `rollout.fleet` name: the one place
    they are turned into code (vLLM's and Ray's modules are imported only when they are named)."""
    if fleet == "ray":
        from .fleet import RayFleet, VllmRayFleet

        return VllmRayFleet if name == "vllm" else RayFleet
    if mode == "async":
        from .async_rollout import GeneratorProcess, VllmGeneratorProcess

        return VllmGeneratorProcess if name == "vllm" else GeneratorProcess
    if name == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine
    return HFEngine


def make_engine(name: str, rt, actor, tokenizer, mode: str = "sync") -> RolloutEngine:
    """The rollout engine `rollout.engine` and `rollout.mode` name, and the actor's config's
    `rollout.fleet`. vLLM, the async generator and the fleet start at their first sync, not here."""
    return engine_class(name, mode, actor.cfg.rollout.fleet)(rt, actor, tokenizer)


def engine_metrics(engine: RolloutEngine | None) -> dict[str, float]:
    """What an engine counts of itself for the step's metrics (the fleet: rollout/fleet/*); {} for the others."""
    return engine.metrics() if engine is not None else {}


if TYPE_CHECKING:  # every engine is a RolloutEngine: mypy fails here (the README's test command) when one stops conforming

    def _conforms(hf: HFEngine, vllm: VllmEngine, gen: GeneratorProcess, vllm_gen: VllmGeneratorProcess,
                  fleet: RayFleet, vllm_fleet: VllmRayFleet) -> list[RolloutEngine]:
        return [hf, vllm, gen, vllm_gen, fleet, vllm_fleet]
