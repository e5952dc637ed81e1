"""The trainer: each step is ``collect`` then ``apply``, journaled in one transaction.

    verlj train --output-dir runs/demo                                   # built-in default
    torchrun --nproc_per_node 2 -m verlj.cli train --output-dir runs/dp2 distributed.zero_stage=3

``collect(step)`` is the expensive, stochastic half, done by the rollout source the config chooses
(``rl.sources``: sync, async in step order, async in completion order; episodes in any of them): draw
prompts, generate, score, decide what enters, leaves and is consumed from the rollout buffer. It
returns :class:`StepInputs`, which is exactly what the journal records. ``apply(step, inputs)`` is
the deterministic half (``rl.update``): log-probs, advantages, DeepSpeed updates, metrics,
fingerprint. Replay (``verlj replay``, ``--resume``) feeds ``apply`` the inputs read back from the
journal (the source puts their buffer changes back: ``take``), so it never generates or scores, and
cannot drift from training because it is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from verlj.journal.failpoints import failpoint

from ..config import Config, ConfigError
from ..dist import Runtime
from ..errors import ModelError, ReplayError
from ..schema.sample import Sample
from ..state.fingerprint import state_fingerprint
from ..state.seeding import derive_seed
from ..state.stateful import check_version
from . import evaluation, lora, update
from .buffer import RolloutBuffer
from .data import Example, Sampler, check_identity, load_data
from .envs import EnvFactory, load_env
from .inputs import StepInputs
from .models import BUILTIN_TINY, ValueModel, load_causal_lm, load_tokenizer, render_chat
from .scoring import Scorer
from .sources import InFlightLog, Parts
from .update import StepOutcome
from .workers import ActorWorker, CriticWorker

if TYPE_CHECKING:
    from ..loop.records import Loaded

__all__ = ["StepInputs", "StepOutcome", "TrainState", "Trainer", "is_timing"]


def is_timing(name: str) -> bool:
    return name.startswith("timing_s/")


class Trainer:
    """Holds the run's Stateful parts (actor (+ reference), critic, sampler, rollout buffer), chooses the
    rollout source, and applies steps."""

    def __init__(self, cfg: Config, rt: Runtime, keep_stages: bool = False) -> None:
        """`keep_stages`: a re-execution for `verlj diff --stages` keeps every stage's values (StepOutcome.kept)."""
        self.cfg, self.rt, self.keep_stages = cfg, rt, keep_stages
        if cfg.data.prompts_per_step % rt.dp_size:
            raise ConfigError(
                f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be divisible by the data-parallel size ({rt.dp_size})"
            )
        mini = cfg.model.actor.mini_batch_size
        if cfg.algorithm.loss_normalization == "global_tokens" and mini % rt.dp_size:
            raise ConfigError(
                f"model.actor.mini_batch_size ({mini}) must be divisible by the data-parallel size ({rt.dp_size}): "
                "each mini-batch is split evenly over the ranks"
            )
        if cfg.model.reward_model.trainable:
            raise ConfigError("model.reward_model.trainable: training the reward model during RL is not supported yet; set it to false")
        seed = cfg.trainer.seed
        self.tokenizer = load_tokenizer(cfg.model.actor.model_name_or_path, cfg=cfg)
        builtin = cfg.model.actor.model_name_or_path == BUILTIN_TINY
        self.data = load_data(cfg.data, seed, render=lambda messages: render_chat(self.tokenizer, messages, builtin))
        self.dataset = self.data.train
        self.prompt_ids = [self._encode_prompt(i, ex) for i, ex in enumerate(self.dataset)]
        self.held_out_ids = [self._encode_prompt(i, ex, "held-out prompt") for i, ex in enumerate(self.data.held_out)]
        self.sampler = Sampler(len(self.dataset), seed)
        self.buffer = RolloutBuffer()
        self.train_state = TrainState(self.sampler)
        self.scorer = Scorer(cfg, rt, self.tokenizer, self.data)  # rewards, the reward model, the reference's log-probs
        init_rng = torch.random.get_rng_state()

        def initial_actor() -> torch.nn.Module:  # the actor's initial weights; also the frozen reference's (loaded when read)
            torch.random.set_rng_state(init_rng)  # a reload draws what the first load drew (weights a checkpoint lacks)
            return load_causal_lm(cfg.model.actor.model_name_or_path, cfg, derive_seed(seed, 0, "init/actor"))

        actor_model, self.actor_base = lora.adapt(initial_actor(), cfg, derive_seed(seed, 0, "init/lora"))
        self.actor = ActorWorker(actor_model, cfg, rt, reference=initial_actor, keep_grads=keep_stages)
        self._env_factory: EnvFactory | None = None  # rollout.env's, made at its first use (replay never plays an episode)
        self.critic: CriticWorker | None = None
        if cfg.algorithm.name == "ppo":
            path = cfg.model.critic.model_name_or_path or cfg.model.actor.model_name_or_path
            backbone = load_causal_lm(path, cfg, derive_seed(seed, 0, "init/critic"), key="model.critic.model_name_or_path")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, 0, "init/value_head"))
                value_model = ValueModel(backbone)
            self.critic = CriticWorker(value_model, cfg, rt, keep_grads=keep_stages)

    def identity(self) -> dict:
        """What the trainer loaded that the config alone does not pin: the prompts (a file's rows, a
        reasoning-gym task's generated ones and its version), the frozen reward model's files, and with
        LoRA the frozen base (rl.lora.base_identity)."""
        return {"reward_model_digest": self.scorer.rm_digest, "dataset": self.data.identity, **self.actor_base}

    def check_identity(self, recorded: Loaded) -> None:
        """On resume: the prompts and the frozen reward model must be the ones the run started with.
        `recorded`: what the run's identity says was loaded (loop.records.Loaded: dataset, reward_model_digest)."""
        check_identity(recorded.dataset, self.data.identity)
        lora.check_base(recorded.actor_base_digest, self.actor_base, self.cfg.model.actor.model_name_or_path)
        want = recorded.reward_model_digest
        if want is not None and want != self.scorer.rm_digest:
            raise ModelError(
                f"model.reward_model.model_name_or_path: the files in {self.cfg.model.reward_model.model_name_or_path} differ "
                "from the reward model this run started with; restore them, or fork the run into a new one"
            )

    def set_config(self, cfg: Config) -> None:
        """Switch to another config of the same run (its live keys may differ: config.check_change)."""
        self.scorer.set_config(cfg)
        made_by = ("env", "max_turns", "env_reward_funcs", "env_reward_weights")  # what rollout.env's factory is made from
        if [getattr(cfg.rollout, k) for k in made_by] != [getattr(self.cfg.rollout, k) for k in made_by]:
            self._env_factory = None
        self.cfg = cfg
        self.actor.set_config(cfg)
        if self.critic is not None:
            self.critic.set_config(cfg)

    def _encode_prompt(self, i: int, ex: Example, what: str = "prompt") -> np.ndarray:
        """A prompt's token ids: <bos> and its text (a chat template that writes its own <bos> keeps just that one)."""
        tok = self.tokenizer
        ids = tok(ex.prompt, add_special_tokens=False).input_ids
        own_bos = ex.messages is not None and tok.bos_token and ex.prompt.startswith(tok.bos_token)
        if tok.bos_token_id is not None and not own_bos:
            ids = [tok.bos_token_id] + ids
        if len(ids) > self.cfg.data.max_prompt_length:
            raise ConfigError(
                f"data.max_prompt_length is {self.cfg.data.max_prompt_length} but {what} {i} has {len(ids)} tokens; raise it"
            )
        return np.asarray(ids, dtype=np.int64)

    def close(self) -> None:
        """Release the DeepSpeed engines (hooks, buffers, threads) so a process can build another run (the rollout's
        engine is its source's: loop.context.Run)."""
        for engine in self.engines().values():
            engine.destroy()
        del self.actor  # what a closed trainer no longer holds
        self.critic = None

    @property
    def policy_version(self) -> int:
        return self.train_state.step  # the update of the last step trained made the actor's weights

    def envs(self) -> EnvFactory:
        """rollout.env's factory (made at its first use: a live collect or eval that plays episodes)."""
        if self._env_factory is None:
            self._env_factory = load_env(self.cfg, self.data.task_dataset)
        assert self._env_factory is not None, "only a config with rollout.env plays episodes"
        return self._env_factory

    def param_layout(self) -> dict[str, dict[str, tuple]]:
        """{engine: {parameter: whole shape}} of what each engine trains (state.reshard)."""
        return {"actor": self.actor.full_shapes, **({"critic": self.critic.full_shapes} if self.critic is not None else {})}

    def engines(self) -> dict:
        return {"actor": self.actor.engine, **({"critic": self.critic.engine} if self.critic is not None else {})}

    def state_fingerprint(self) -> tuple[str, dict[str, str]]:
        """The fingerprint of the trained state now (every engine's, of trainer.state_digest's kind)
        and its parts by engine. Collective."""
        return state_fingerprint(self.engines(), self.rt, self.cfg.trainer.state_digest)

    # ================================================================== the rollout: its parts, and what a step takes

    def rollout_parts(self, durable: InFlightLog | None) -> Parts:
        """What the run's rollout source and its player are made of (rl.sources.make_source): the config in force, the
        ranks, the tokenizer, the dataset and its prompts, the buffer and sampler, the scorer, the actor, rollout.env's
        factory; `durable`: where completion order makes what is in flight durable (the run's journal)."""
        return Parts(self.cfg, self.rt, self.tokenizer, self.dataset, self.prompt_ids, self.buffer, self.sampler, self.scorer,
                     self.actor, self.envs, durable)

    def take(self, step: int, inputs: StepInputs) -> list[Sample]:
        """Consume the step's samples from the buffer, once its batches are in it (a live collect admitted them; replay:
        the source's `replayed`), checked against the plan made when they were generated. Live and replay both come
        through here."""
        planned = self.buffer.plans.pop(step, None)
        if planned is not None:
            if not np.array_equal(planned, inputs.consumed):
                raise ReplayError(f"step {step} consumes other samples than the plan made when its batch was generated")
            failpoint("async.consume")
        elif inputs.requests is not None:
            failpoint("async.consume")
        samples = self.buffer.consume(inputs.consumed)
        self.train_state.step = step
        self.train_state.samples_seen += len(samples)
        return samples

    def advance_sampler(self, inputs: StepInputs) -> None:
        """Replay: the sampler ends where the journal says this step left it."""
        self.sampler.move_to(inputs.data.epoch, inputs.data.cursor)

    def rescore(self, samples: list[Sample], model: bool = False) -> None:
        """`verlj rerun`, what-ifs: journaled samples scored again with the config's reward (Scorer.rescore)."""
        self.scorer.rescore(samples, model)

    # ================================================================== apply: deterministic (rl.update)

    def apply(self, step: int, inputs: StepInputs, samples: list[Sample]) -> StepOutcome:
        """The deterministic half of a step (rl.update.apply): the same code serves live training and
        replay, which feeds it journaled inputs: the same inputs give the same bits. Collective."""
        return update.apply(self, step, inputs, samples)

    def eval_due(self, step: int) -> bool:
        return bool(self.cfg.trainer.eval_interval) and step % self.cfg.trainer.eval_interval == 0

    def evaluate(self, step: int) -> tuple[dict[str, float], dict, str]:
        """The held-out eval after step `step`'s update (rl.evaluation). Live steps only. Collective."""
        return evaluation.evaluate(self, step)

    # ================================================================== Stateful parts

    def state_parts(self) -> dict:
        """The trainer's rank-agnostic Stateful parts, by name (snapshots loop over these; the
        DeepSpeed engines are the sharded parts: see engines())."""
        return {"sampler": self.sampler, "buffer": self.buffer, "train_state": self.train_state}


class TrainState:
    """What the loop itself carries from step to step: the cumulative samples trained on. Stateful."""

    VERSION = 1

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.step = 0
        self.samples_seen = 0

    def trainer_state(self) -> dict:
        return {"global_step": self.step, "epoch": self.sampler.epoch, "samples_seen": self.samples_seen}

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        saved = TrainStateRecord(**check_version("train", state, self.VERSION))
        self.step, self.samples_seen = int(saved.step), int(saved.samples_seen)


@dataclass(frozen=True)
class TrainStateRecord:
    """TrainState's part of a snapshot (its anchor), field for field."""

    version: int
    step: int
    samples_seen: int
