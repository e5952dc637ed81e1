"""Run configuration: documented dataclasses, YAML files, dotted command-line overrides.

    verlj config show                                   # the built-in default
    verlj config show --config ppo_config.yaml trainer.total_steps=40 algorithm.name=ppo

Sections follow the shape verl users know (trainer / algorithm / model / data / rollout /
distributed / logging). Every field's comment is its documentation. A wrong key, type or
value raises :class:`ConfigError` with one sentence naming the key and what is allowed.

Each field also declares, where it is declared, what a change to it means for a run in progress
(:func:`check_change` is the one place that applies it, for resume and fork alike):

- fixed (the default): shapes the engines, the data or the random streams; never changes in a run;
- ``live(...)``: read by the trainer every step; may change on resume with --allow-config-change
  or on fork, and replay applies each step under the config in force when it was journaled;
- ``bookkeeping(...)``: shapes only the future or the logs (steps to run, snapshots, logging);
  may always change on resume, and is left out of the config hash;
- ``topology(...)``: how the state is laid out over the ranks (ZeRO stage, TP size); may change on
  any resume, like the number of ranks: the snapshot is resharded (state.reshard) and the replayed
  steps are checked within a tolerance (loop.recovery).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import blake3
import yaml

from .errors import ConfigError, install_hint

FIXED, LIVE, BOOKKEEPING, TOPOLOGY = "fixed", "live", "bookkeeping", "topology"
VERIFIERS = "verifiers:"  # data.train_dataset=verifiers:TASKSET with rollout.agent=verifiers:TASKSET
REASONING_GYM = "reasoning_gym"  # data.train_dataset=reasoning_gym:TASK, rollout.reward_fn=reasoning_gym
MAX_SEED = 2**63 - 1  # seeds are journaled as msgpack integers and seed int64 generators


def live(default):
    """A field the trainer reads every step: changeable on resume (--allow-config-change) or fork."""
    return field(default=default, metadata={"policy": LIVE})


def bookkeeping(default):
    """A field that shapes only the future or the logs: changeable on any resume."""
    return field(default=default, metadata={"policy": BOOKKEEPING})


def topology(default):
    """A field that lays the state out over the ranks: changeable on any resume (resharded)."""
    return field(default=default, metadata={"policy": TOPOLOGY})


# ----------------------------------------------------------------------------- the choices


class Choice(str, enum.Enum):
    """The values a config key may take. A member is its YAML value: it compares, hashes, prints and is
    stored as that string (`Config.to_dict` gives the plain strings); a value outside them is read as
    the string it is, and refused by the section's validate in the words it always had (_choice)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)


class Device(Choice):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Precision(Choice):
    FP32 = "fp32"
    BF16 = "bf16"


class StateDigest(Choice):
    SUM64 = "sum64"
    BLAKE3 = "blake3"


class AlgorithmName(Choice):
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    PPO = "ppo"


class LossAggMode(Choice):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


# TRL's GRPOTrainer loss_type names, read as the loss_agg_mode each computes (docs/concepts/algorithms.md)
TRL_LOSS_TYPES: dict[str, Choice] = {"grpo": LossAggMode.SEQ_MEAN_TOKEN_MEAN, "bnpo": LossAggMode.TOKEN_MEAN,
                                     "dapo": LossAggMode.TOKEN_MEAN, "dr_grpo": LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM}
ALIASES: dict[type, dict[str, Choice]] = {LossAggMode: TRL_LOSS_TYPES}  # a Choice's other names, each read as its member


class LossMode(Choice):
    VANILLA = "vanilla"
    GSPO = "gspo"


class LossNormalization(Choice):
    GLOBAL_TOKENS = "global_tokens"
    MICRO_BATCH = "micro_batch"


class Vocab(Choice):
    AUTO = "auto"
    DIGITS = "digits"
    ASCII = "ascii"


class EngineName(Choice):
    HF = "hf"
    VLLM = "vllm"


class AnswerFormat(Choice):
    TEXT = "text"
    ANSWER_TAG = "answer_tag"


class Mode(Choice):
    SYNC = "sync"
    ASYNC = "async"


class Order(Choice):
    STEP = "step"
    COMPLETION = "completion"


class Fleet(Choice):
    NONE = "none"
    RAY = "ray"


class Overlong(Choice):
    KEEP = "keep"
    MASK = "mask"
    REWARD = "reward"
    PENALTY = "penalty"


class Backend(Choice):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Placement(Choice):
    PACK = "pack"
    SPREAD = "spread"


class Progress(Choice):
    AUTO = "auto"
    BAR = "bar"
    LINES = "lines"
    OFF = "off"


# ----------------------------------------------------------------------------- sections


@dataclass
class TrainerConfig:
    total_steps: int = bookkeeping(200)  # training steps (one step = one rollout batch and its update)
    seed: int = 1  # run seed; every per-step seed is derived from it
    save_interval: int = bookkeeping(50)  # snapshot every N steps (0 = never, apart from the final one)
    save_total_limit: int = bookkeeping(3)  # keep at most N snapshots (0 = keep all)
    resume_from: Optional[str] = bookkeeping(None)  # null | auto | a snapshot path | a step number
    checkpoint_policy: Optional[str] = bookkeeping(None)  # dotted path of a CheckpointPolicy class
    checkpoint_policy_kwargs: dict = field(default_factory=dict, metadata={"policy": BOOKKEEPING})  # its constructor's arguments
    async_save: bool = bookkeeping(False)  # write snapshots in the background
    # hold the state after every Nth committed step in this machine's shared memory (two slots, written in the
    # background), so that a restart here loads it instead of a snapshot from disk and replays fewer steps
    # (0 = never; loop/mirror.py); it needs about a snapshot's bytes three times where mirror_dir is (two held, one written)
    mirror_interval: int = bookkeeping(0)
    mirror_dir: Optional[str] = bookkeeping(None)  # where mirrors go (null: /dev/shm, else the temporary directory)
    eval_interval: int = bookkeeping(0)  # score the policy on the held-out prompts every N steps (0 = never; data.eval_size)
    device: Device = Device.AUTO  # auto | cpu | cuda
    # fp32 | bf16 (DeepSpeed's bf16 configuration: bf16 weights and compute, fp32 master weights and Adam state in
    # the optimizer, which snapshots and fingerprints cover; killed and resumed bit-identical, on CPU too)
    precision: Precision = Precision.FP32
    num_threads: int = 1  # torch intra-op threads per rank (fixed for reproducibility)
    deterministic: bool = True  # torch.use_deterministic_algorithms(True)
    # the per-step state fingerprint: sum64 (position-weighted int64 sums computed where the tensors
    # live: a few bytes a tensor leave the device) | blake3 (every tensor copied to the host and
    # hashed: runs made before sum64 keep it)
    state_digest: StateDigest = StateDigest.SUM64
    # a plain `verlj train` supervises the process that trains and restarts it with --resume when it
    # dies (killed, crashed) at most N times; one command's choice, never stored with the run (under
    # torchrun: `torchrun --max-restarts N`, each restart resumes by itself)
    max_restarts: int = bookkeeping(0)

    def validate(self) -> None:
        _positive("trainer.total_steps", self.total_steps)
        _at_least("trainer.max_restarts", self.max_restarts, 0)
        _at_least("trainer.save_interval", self.save_interval, 0)
        _at_least("trainer.save_total_limit", self.save_total_limit, 0)
        _at_least("trainer.mirror_interval", self.mirror_interval, 0)
        _at_least("trainer.eval_interval", self.eval_interval, 0)
        _range("trainer.seed", self.seed, 0, MAX_SEED)
        if self.resume_from is not None and self.resume_from != "auto" and self.resume_from.lstrip("+-").isdigit() \
                and int(self.resume_from) < 0:
            raise ConfigError(f"trainer.resume_from must be null, auto, a snapshot path or a step number >= 0, got {self.resume_from}")
        _positive("trainer.num_threads", self.num_threads)
        _choice("trainer.device", self.device, Device)
        _choice("trainer.precision", self.precision, Precision)
        _choice("trainer.state_digest", self.state_digest, StateDigest)


@dataclass
class AlgorithmConfig:
    # the advantage estimator (verl's algorithm.adv_estimator): grpo | rloo | reinforce_plus_plus | ppo
    # (GAE with a critic); see docs/concepts/algorithms.md
    name: AlgorithmName = AlgorithmName.GRPO
    gamma: float = live(1.0)  # PPO: discount for GAE; REINFORCE++: for the returns
    lam: float = live(0.95)  # PPO: GAE lambda
    kl_coef: float = live(0.0)  # PPO, REINFORCE++: KL-to-reference penalty folded into token rewards
    norm_adv_by_std: bool = live(True)  # GRPO: divide group-centred rewards by the group std
    dynamic_sampling: bool = live(False)  # DAPO: drop groups whose rewards do not vary, draw more prompts
    max_sampling_rounds: int = live(4)  # dynamic sampling: generation rounds per step at most
    # async rollout: each token's loss is weighted by min(pi_old / pi_gen, this) (truncated importance
    # sampling, as verl's rollout correction): pi_old the policy the step starts from, pi_gen the generator's
    rollout_is_threshold: float = live(2.0)
    # global_tokens: each mini-batch's loss is the token-mean over all its samples on all ranks, the
    # same objective at any world size | micro_batch: each micro-batch's own token-mean (runs made
    # before verlj had this key; their objective changes with the split, so they resume on the same topology)
    loss_normalization: LossNormalization = LossNormalization.GLOBAL_TOKENS
    # how the actor's per-token losses become one (verl's loss_agg_mode): token-mean | seq-mean-token-sum |
    # seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO: token sums over samples x rollout.max_response_length);
    # TRL's loss_type names are read as these: grpo = seq-mean-token-mean, bnpo and dapo = token-mean, dr_grpo = seq-mean-token-sum-norm
    loss_agg_mode: LossAggMode = live(LossAggMode.TOKEN_MEAN)

    def validate(self) -> None:
        _choice("algorithm.name", self.name, AlgorithmName)
        _choice("algorithm.loss_agg_mode", self.loss_agg_mode, LossAggMode)
        _choice("algorithm.loss_normalization", self.loss_normalization, LossNormalization)
        _range("algorithm.gamma", self.gamma, 0.0, 1.0)
        _range("algorithm.lam", self.lam, 0.0, 1.0)
        _at_least("algorithm.kl_coef", self.kl_coef, 0.0)
        _positive("algorithm.max_sampling_rounds", self.max_sampling_rounds)
        _positive("algorithm.rollout_is_threshold", self.rollout_is_threshold)


@dataclass
class OptimConfig:
    lr: float = live(1e-3)  # AdamW learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear LR warm-up, in optimizer steps
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    # torch's fused AdamW kernel (each parameter's update in one pass over its state; what Hugging Face's
    # Trainer picks); false: torch's default (a tensor at a time on CPU, foreach on GPU; other rounding)
    fused: bool = True

    def validate(self, prefix: str) -> None:
        _positive(f"{prefix}.lr", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1), got {self.betas}")
        _positive(f"{prefix}.eps", self.eps)
        _at_least(f"{prefix}.weight_decay", self.weight_decay, 0.0)
        _at_least(f"{prefix}.warmup_steps", self.warmup_steps, 0)
        _at_least(f"{prefix}.grad_clip", self.grad_clip, 0.0)


@dataclass
class TinyModelConfig:
    hidden_size: int = 64  # built-in tiny Llama: width
    num_layers: int = 2  # built-in tiny Llama: decoder layers
    num_heads: int = 2  # built-in tiny Llama: attention heads (head size 32: both rollout engines run it)
    intermediate_size: int = 128  # built-in tiny Llama: MLP width
    # its character vocabulary: digits (0-9 + - * = and space: the built-in task) | ascii (printable
    # ASCII and newline) | auto (digits for builtin:add, ascii for any other dataset)
    vocab: Vocab = Vocab.AUTO

    def validate(self) -> None:
        for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _positive(f"model.tiny.{k}", getattr(self, k))
        _choice("model.tiny.vocab", self.vocab, Vocab)
        if self.hidden_size % self.num_heads:
            raise ConfigError("model.tiny.hidden_size must be a multiple of model.tiny.num_heads")


@dataclass
class ActorConfig:
    model_name_or_path: str = "builtin:tiny"  # builtin:tiny, or a local Hugging Face model directory
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = live(1)  # passes over each step's samples
    mini_batch_size: int = live(0)  # samples per optimizer step per step (0 = all of the step's samples)
    micro_batch_size: int = 8  # samples per forward/backward per rank
    clip_ratio: float = live(0.2)  # PPO/GRPO ratio clip
    clip_ratio_low: Optional[float] = live(None)  # the ratio's lower clip, 1 - this (null = clip_ratio)
    clip_ratio_high: Optional[float] = live(None)  # its upper clip, 1 + this (DAPO's clip-higher; null = clip_ratio)
    # the policy loss (verl's policy_loss.loss_mode): vanilla (PPO's clipped token ratios) | gspo (GSPO's sequence ratio)
    loss_mode: LossMode = live(LossMode.VANILLA)
    entropy_coeff: float = live(0.0)  # entropy bonus weight
    use_kl_loss: bool = live(True)  # GRPO, RLOO, REINFORCE++: KL-to-reference term in the loss (k3 estimator)
    kl_loss_coef: float = live(0.01)  # GRPO, RLOO, REINFORCE++: weight of that term
    lora_rank: int = 0  # LoRA adapters of this rank on the frozen base (verl's lora_rank; 0 = off: every weight trained); see docs/guides/lora.md
    lora_alpha: float = 16.0  # LoRA scaling numerator: the adapters' update is scaled by lora_alpha / lora_rank
    target_modules: Union[str, list[str]] = "all-linear"  # LoRA: the modules adapted: all-linear (every linear layer but the output head), or a list of module names (e.g. [q_proj, v_proj])

    def validate(self) -> None:
        self.optim.validate("model.actor.optim")
        _at_least("model.actor.lora_rank", self.lora_rank, 0)
        if self.lora_rank and not self.lora_alpha > 0:
            raise ConfigError(f"model.actor.lora_alpha must be positive, got {self.lora_alpha}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ConfigError(f"model.actor.target_modules must be all-linear or a list of module names, got {self.target_modules!r}")
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ConfigError("model.actor.target_modules is an empty list; name the modules to adapt, or all-linear")
        _positive("model.actor.ppo_epochs", self.ppo_epochs)
        _at_least("model.actor.mini_batch_size", self.mini_batch_size, 0)
        _positive("model.actor.micro_batch_size", self.micro_batch_size)
        _range("model.actor.clip_ratio", self.clip_ratio, 0.0, 1.0)
        if self.clip_ratio_low is not None:
            _range("model.actor.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0)
        if self.clip_ratio_high is not None:
            _at_least("model.actor.clip_ratio_high", self.clip_ratio_high, 0.0)
        _choice("model.actor.loss_mode", self.loss_mode, LossMode)
        _at_least("model.actor.kl_loss_coef", self.kl_loss_coef, 0.0)


@dataclass
class CriticConfig:
    model_name_or_path: Optional[str] = None  # backbone for the value head (null = the actor's)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cliprange_value: float = live(0.5)  # PPO value clipping
    micro_batch_size: int = 8  # samples per forward/backward per rank

    def validate(self) -> None:
        self.optim.validate("model.critic.optim")
        _at_least("model.critic.cliprange_value", self.cliprange_value, 0.0)
        _positive("model.critic.micro_batch_size", self.micro_batch_size)


@dataclass
class RewardModelConfig:
    model_name_or_path: Optional[str] = None  # local sequence-classification model dir (null = rule-based only)
    trainable: bool = False  # reward models are frozen unless this is set
    weight: float = live(1.0)  # score = rule reward + weight * reward-model score

    def validate(self) -> None:
        pass


@dataclass
class ModelConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def validate(self) -> None:
        self.actor.validate()
        self.critic.validate()
        self.reward_model.validate()
        self.tiny.validate()


@dataclass
class ReasoningGymConfig:
    size: int = 1000  # rows generated for training (the held-out rows, data.eval_size, come after them)
    seed: Optional[int] = None  # the generator's seed (null = trainer.seed)
    config: dict = field(default_factory=dict)  # the task's own config (one task), or {task: its config} for several
    weights: dict = field(default_factory=dict)  # several tasks: {task: weight} (default 1 each), as reasoning-gym's composite

    def validate(self) -> None:
        _positive("data.reasoning_gym.size", self.size)
        if self.seed is not None:
            _range("data.reasoning_gym.seed", self.seed, 0, 2**31 - 1)
        for task, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                raise ConfigError(f"data.reasoning_gym.weights.{task} must be a positive number, got {w!r}")


@dataclass
class DataConfig:
    # builtin:add | reasoning_gym:TASK (or TASK,TASK,...: several, mixed by data.reasoning_gym.weights) |
    # a .jsonl / .parquet file of prompts
    train_dataset: str = "builtin:add"
    prompt_key: str = "prompt"  # field holding the prompt: a string, or chat messages [{role, content}] (the chat template renders them); a dotted path reaches a nested field
    answer_key: str = "answer"  # field holding the ground truth for rule rewards; a dotted path reaches a nested field (verl: reward_model.ground_truth)
    num_examples: int = 512  # builtin:add: how many problems to generate
    max_operand: int = 9  # builtin:add: operands are drawn from 0..max_operand
    prompts_per_step: int = 16  # prompts per step (verl's data.train_batch_size)
    max_prompt_length: int = 64  # longer prompts are refused when the dataset loads
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)  # reasoning_gym:TASK datasets
    # held-out prompts for the eval pass (trainer.eval_interval): a generated dataset generates this many
    # rows after its training rows, and no held-out prompt is trained on (training rows that repeat one
    # are left out) | 0: none
    eval_size: int = 0
    eval_dataset: Optional[str] = None  # a .jsonl / .parquet file of held-out prompts (null = held out of a generated dataset)

    def validate(self) -> None:
        self.reasoning_gym.validate()
        _at_least("data.eval_size", self.eval_size, 0)
        _positive("data.num_examples", self.num_examples)
        _at_least("data.max_operand", self.max_operand, 1)
        _positive("data.prompts_per_step", self.prompts_per_step)
        _positive("data.max_prompt_length", self.max_prompt_length)


@dataclass
class RolloutConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = live(1.0)  # sampling temperature
    top_p: float = live(1.0)  # nucleus sampling
    max_response_length: int = live(4)  # tokens generated per sample at most
    ignore_eos: bool = False  # keep generating past eos to max_response_length (benchmarks)
    # auto (the dataset's own scorer: builtin:add for builtin:add, reasoning_gym for reasoning_gym:...) |
    # builtin:add | reasoning_gym (the task's own score_answer) | module:function(prompt, response, answer) -> float
    reward_fn: str = live("auto")
    answer_format: AnswerFormat = live(AnswerFormat.TEXT)  # what a scorer gets of the response: text (all of it, stripped) | answer_tag (inside the last <answer></answer>)
    eval_temperature: float = bookkeeping(0.0)  # sampling temperature of the eval pass (0 = greedy)
    engine: EngineName = live(EngineName.HF)  # hf (verlj's KV-cached sampler) | vllm (a colocated vLLM engine: pip install -e '.[vllm]')
    gpu_memory_utilization: float = bookkeeping(0.5)  # vllm on GPU: the share of GPU memory vLLM takes (on CPU, KV memory is sized to the batch)
    # sync: each step generates its own batch, then trains on it | async: a generator process beside
    # the trainer generates the batch of step s+k while step s trains (docs/guides/async.md)
    mode: Mode = Mode.SYNC
    max_staleness: Optional[int] = None  # async: k, the policy versions a trained sample may lag (>= 1; null = 1)
    # async: step (deterministic: step s trains on version max(0, s-1-k); null = step) | completion
    # (free-running: each step takes the completed groups within k versions, in completion order)
    async_order: Optional[Order] = None
    # async completion order: partial rollouts: when the trainer pushes new weights, a generation in flight stops at
    # its next token and goes on under the new weights from the same seed stream, each token's policy version journaled
    # (a push waits for no long generation) | false: a push waits for the generations begun to end (docs/guides/async.md)
    partial: bool = False
    # rollout.partial: a sample whose oldest token is more than this many policy versions behind the policy a step
    # starts from is dropped when that step would train it (buffer.drop reason stale; rollout/dropped_stale) | null: none
    # is dropped for its age (rollout.max_staleness's look-ahead paces how far generation runs ahead)
    max_token_staleness: Optional[int] = live(None)
    # async: none (the generator process beside each rank) | ray (rollout.fleet_size generator actors on a
    # Ray cluster: pip install 'verlj[ray]'; docs/guides/async.md: a rollout fleet on Ray)
    fleet: Fleet = live(Fleet.NONE)
    fleet_size: int = bookkeeping(1)  # fleet=ray: M, the generator actors (may change on resume)
    # fleet=ray: the Ray resources each actor asks for: num_cpus, num_gpus, memory (bytes), or a custom resource's name
    fleet_resources: dict = field(default_factory=lambda: {"num_cpus": 1}, metadata={"policy": BOOKKEEPING})
    fleet_timeout_s: float = bookkeeping(300.0)  # fleet=ray: the run stops when no actor has been alive for this long
    # multi-turn episodes (rl.envs; docs/guides/environments.md): null (none: one response a sample) |
    # builtin:calculator | builtin:equals | builtin:guess | builtin:reasoning_gym | module:Class (yours, made with no arguments)
    # | trl:module:Class (a TRL environment_factory class: its public methods the model's tools)
    # | openenv:URL (an OpenEnv server's env, one WebSocket session an episode: pip install 'verlj[openenv]')
    env: Optional[str] = live(None)
    # rollout.env=openenv:URL: a command that serves the env at URL, started before training, health-checked and
    # stopped at exit | null: a server you started
    openenv_command: Optional[str] = bookkeeping(None)
    # rollout.env=openenv:URL: module:Class, a subclass of rl.openenv_envs.TextAdapter (the env's own client class, how the
    # policy's text becomes its action) | null: the text in the action's one string field
    openenv_adapter: Optional[str] = live(None)
    max_turns: int = live(1)  # rollout.env: the policy's actions per episode at most (the built-ins end their episodes within it)
    # rollout.env=trl:module:Class: TRL's reward_funcs, module:function each, called at an episode's end as TRL calls
    # them (prompts, completions, completion_ids, environments=[the episode's instance], the row's columns, **kwargs)
    env_reward_funcs: list[str] = field(default_factory=list, metadata={"policy": LIVE})
    # rollout.env_reward_funcs: TRL's reward_weights, one per function | []: 1.0 each (get_reward's weight is 1)
    env_reward_weights: list[float] = field(default_factory=list, metadata={"policy": LIVE})
    env_timeout_s: float = bookkeeping(30.0)  # rollout.env: an env call (reset, step) that has not answered in this many seconds is a fault
    # rollout.env: an observation (reset's too) is cut to this many tokens, ending with " [truncated]" | 0: no cap
    max_observation_length: int = live(256)
    # rollout.env: an episode ends (by length, not a fault) once its context (prompt, actions, observations)
    # leaves no room for another action of rollout.max_response_length tokens below this | 0: no cap
    max_episode_length: int = live(0)
    # a step where more than this share of the samples it generated ended by a fault (an env's, a reward
    # function's: rl.faults) is not committed and the run stops in one line | 1: never stop (faults are left out of the update either way)
    max_fault_rate: float = bookkeeping(0.5)
    # a sample that hit the length limit (rl.overlong: a response that reached rollout.max_response_length without its
    # end-of-sequence token, an episode ended by rollout.max_episode_length, an agent episode whose last answer was cut):
    # keep (scored and trained as any sample) | mask (out of the loss, its score still in its group's statistics: DAPO's
    # overlong filtering) | reward (scored rollout.overlong_reward) | penalty (DAPO's soft overlong punishment: a sample
    # whose last generation is within rollout.overlong_buffer tokens of rollout.max_response_length loses up to
    # rollout.overlong_penalty from its score, linearly, a cut one all of it)
    overlong: Overlong = live(Overlong.KEEP)
    overlong_reward: float = live(0.0)  # rollout.overlong=reward: the score of a sample that hit the length limit
    overlong_buffer: int = live(0)  # rollout.overlong=penalty: the tokens before rollout.max_response_length where the penalty grows
    overlong_penalty: float = live(1.0)  # rollout.overlong=penalty: what a sample at the limit loses from its score
    # agent programs as rollouts (rl.gateway; docs/guides/agents.md): null (none) | module:function (called
    # with an episode: base_url, api_key, model, row, seed, max_turns; returns its reward, or None for
    # rollout.reward_fn) | cmd:COMMAND (a program told OPENAI_BASE_URL, OPENAI_API_KEY, VERLJ_MODEL, VERLJ_ROW,
    # VERLJ_SEED; its reward the last line it prints). Its calls per episode: at most rollout.max_turns
    agent: Optional[str] = live(None)
    agent_concurrency: int = bookkeeping(8)  # rollout.agent: episodes whose agents run at once (their waiting calls generated together)
    # rollout.agent: an agent that neither calls the model nor returns for this many seconds after its last answer is a fault
    agent_timeout_s: float = bookkeeping(60.0)
    # rollout.agent: tools the gateway serves over MCP at episode.mcp_url, every call journaled and an external one never sent twice
    # (rl.gateway.tools): Python functions (module:function: @tool(effect=pure|restorable|external, reconcile=...); a plain
    # function: external) and MCP servers of yours (an http(s):// URL, or cmd:COMMAND started over stdio), forwarded
    tools: list[str] = field(default_factory=list, metadata={"policy": LIVE})
    # rollout.tools: a tool's effect by its name (pure | restorable | external), over what @tool says; an MCP server's tools: external
    tool_effects: dict = field(default_factory=dict, metadata={"policy": LIVE})

    def validate(self) -> None:
        _positive("rollout.n", self.n)
        _choice("rollout.engine", self.engine, EngineName)
        _range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.01, 1.0)
        _positive("rollout.temperature", self.temperature)
        _range("rollout.top_p", self.top_p, 1e-6, 1.0)
        _positive("rollout.max_response_length", self.max_response_length)
        _at_least("rollout.eval_temperature", self.eval_temperature, 0.0)
        _choice("rollout.answer_format", self.answer_format, AnswerFormat)
        if not (self.reward_fn in ("auto", REASONING_GYM) or self.reward_fn.startswith("builtin:") or ":" in self.reward_fn):
            raise ConfigError(f"rollout.reward_fn must be auto, reasoning_gym, builtin:NAME or module:function, got {self.reward_fn!r}")
        _choice("rollout.mode", self.mode, Mode)
        if self.mode == "sync":
            for key in ("max_staleness", "async_order"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"rollout.{key} applies to rollout.mode=async only; remove it or set rollout.mode=async")
        else:
            if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or self.max_staleness < 1):
                raise ConfigError(f"rollout.max_staleness must be an integer of at least 1, got {self.max_staleness!r}")
            if self.async_order is not None:
                _choice("rollout.async_order", self.async_order, Order)
        self._validate_partial()
        self._validate_env()
        self._validate_overlong()
        _choice("rollout.fleet", self.fleet, Fleet)
        if self.fleet == "ray":
            if self.mode != "async":
                raise ConfigError("rollout.fleet=ray applies to rollout.mode=async only; set rollout.mode=async or rollout.fleet=none")
            _positive("rollout.fleet_size", self.fleet_size)
            _positive("rollout.fleet_timeout_s", self.fleet_timeout_s)
            if not isinstance(self.fleet_resources, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for k, v in self.fleet_resources.items()):
                raise ConfigError("rollout.fleet_resources must map resource names to amounts >= 0, e.g. {num_gpus: 1}, "
                                  f"got {self.fleet_resources!r}")
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ConfigError(f"rollout.fleet=ray needs ray: {install_hint('ray')}") from None

    def _validate_partial(self) -> None:
        if self.max_token_staleness is not None and not self.partial:
            raise ConfigError("rollout.max_token_staleness applies to rollout.partial=true only; remove it or set rollout.partial=true")
        if not self.partial:
            return
        if not self.free_running:
            raise ConfigError("rollout.partial=true continues generations across weight updates in async completion order only; "
                              "set rollout.mode=async and rollout.async_order=completion, or rollout.partial=false")
        if self.env is not None or self.agent is not None:
            raise ConfigError(f"rollout.partial=true does not combine with rollout.{'env' if self.env is not None else 'agent'} yet "
                              "(a turn or a model call is generated whole); set rollout.partial=false")
        if self.max_token_staleness is not None and (isinstance(self.max_token_staleness, bool) or self.max_token_staleness < self.staleness):
            raise ConfigError(f"rollout.max_token_staleness must be an integer of at least rollout.max_staleness ({self.staleness}): "
                              f"a sample generated whole is that old when trained; got {self.max_token_staleness!r}")

    def _validate_overlong(self) -> None:
        _choice("rollout.overlong", self.overlong, Overlong)
        _at_least("rollout.overlong_buffer", self.overlong_buffer, 0)
        if self.overlong == Overlong.PENALTY and not 1 <= self.overlong_buffer <= self.max_response_length:
            raise ConfigError(f"rollout.overlong=penalty needs rollout.overlong_buffer between 1 and rollout.max_response_length "
                              f"({self.max_response_length}): the tokens before the limit where the penalty grows; got {self.overlong_buffer}")

    def _validate_env(self) -> None:
        _positive("rollout.max_turns", self.max_turns)
        _positive("rollout.env_timeout_s", self.env_timeout_s)
        _range("rollout.max_fault_rate", self.max_fault_rate, 0.0, 1.0)
        _at_least("rollout.max_observation_length", self.max_observation_length, 0)
        _at_least("rollout.max_episode_length", self.max_episode_length, 0)
        self._validate_agent()
        if (self.env_reward_funcs or self.env_reward_weights) and not (self.env or "").startswith("trl:"):
            raise ConfigError("rollout.env_reward_funcs and rollout.env_reward_weights score a TRL environment class's "
                              "episodes: they need rollout.env=trl:module:Class")
        if (self.openenv_command is not None or self.openenv_adapter is not None) and not (self.env or "").startswith("openenv:"):
            raise ConfigError("rollout.openenv_command and rollout.openenv_adapter apply to rollout.env=openenv:URL only; remove them")
        if self.env is None:
            if self.max_turns > 1 and self.agent is None:
                raise ConfigError("rollout.max_turns > 1 needs rollout.env (without an environment a sample is one response)")
            return
        if not (self.env.startswith("builtin:") or ":" in self.env.strip(":")):
            raise ConfigError(f"rollout.env must be null, builtin:NAME, module:Class or trl:module:Class, got {self.env!r}")
        if self.env.startswith("trl:") and ":" not in self.env[4:].strip(":"):
            raise ConfigError(f"rollout.env=trl: names a TRL environment class as trl:module:Class, got {self.env!r}")
        if self.env_reward_weights and len(self.env_reward_weights) != len(self.env_reward_funcs):
            raise ConfigError(f"rollout.env_reward_weights has {len(self.env_reward_weights)} weights for "
                              f"{len(self.env_reward_funcs)} rollout.env_reward_funcs: give one each, or none (1.0 each)")

    def _validate_agent(self) -> None:
        _positive("rollout.agent_concurrency", self.agent_concurrency)
        _positive("rollout.agent_timeout_s", self.agent_timeout_s)
        if self.agent is None:
            if self.tools:
                raise ConfigError("rollout.tools are served to agent programs: set rollout.agent too (an agent that connects to episode.mcp_url)")
            return
        if any(":" not in t.strip(":") for t in self.tools):
            raise ConfigError(f"rollout.tools names Python tools as module:function and MCP servers as a URL or cmd:COMMAND, got {self.tools!r}")
        bad = {k: v for k, v in self.tool_effects.items() if v not in ("pure", "restorable", "external")}
        if bad:
            raise ConfigError(f"rollout.tool_effects gives {bad}: a tool's effect is pure, restorable or external")
        if not (self.agent.startswith("cmd:") or ":" in self.agent.strip(":")):
            raise ConfigError(f"rollout.agent must be null, module:function or cmd:COMMAND, got {self.agent!r}")
        if self.env is not None:
            raise ConfigError("rollout.agent and rollout.env are two ways to play episodes; set one of them")
        try:
            import uvicorn  # noqa: F401
        except ImportError:
            raise ConfigError(f"rollout.agent needs the gateway's server: {install_hint('agent')}") from None

    @property
    def fleet_gpus(self) -> float:
        """fleet=ray: the GPUs each actor asks for (rollout.fleet_resources' num_gpus; 0 when it names none)."""
        return float(self.fleet_resources.get("num_gpus", 0))

    @property
    def staleness(self) -> int:
        """k: 0 in sync mode (step s trains on version s-1), max_staleness (default 1) in async mode."""
        return 0 if self.mode == "sync" else (self.max_staleness or 1)

    @property
    def free_running(self) -> bool:
        """rollout.async_order=completion: the generator runs ahead on its own, timing decides what a step takes."""
        return self.mode == "async" and self.async_order == "completion"


@dataclass
class DistributedConfig:
    zero_stage: int = topology(0)  # DeepSpeed ZeRO stage 0-3
    tensor_parallel_size: int = topology(1)  # DeepSpeed AutoTP degree (tensor_parallel.autotp_size)
    backend: Backend = Backend.AUTO  # auto (gloo on CPU, nccl on GPU) | gloo | nccl
    # rollout.fleet=ray and `verlj train --launcher ray`: the Ray cluster to join (RAY_ADDRESS wins; null
    # and unset: verlj starts a local one)
    ray_address: Optional[str] = bookkeeping(None)
    # `verlj train --launcher ray`: how the placement group lays out its bundles, one per rank: pack (as
    # few nodes as will hold them) | spread (over as many nodes as there are); one command's choice,
    # never stored with the run
    placement: Placement = bookkeeping(Placement.PACK)

    def validate(self) -> None:
        _range("distributed.zero_stage", self.zero_stage, 0, 3)
        _positive("distributed.tensor_parallel_size", self.tensor_parallel_size)
        _choice("distributed.backend", self.backend, Backend)
        _choice("distributed.placement", self.placement, Placement)


@dataclass
class LoggingConfig:
    log_interval: int = bookkeeping(1)  # print a line every N steps
    progress: Progress = bookkeeping(Progress.AUTO)  # auto (a bar on a terminal, lines otherwise) | bar | lines | off
    jsonl: bool = bookkeeping(True)  # write RUN/metrics.jsonl
    tensorboard: bool = bookkeeping(False)  # write TensorBoard event files under RUN/tensorboard
    wandb: bool = bookkeeping(False)  # log metrics to Weights & Biases (pip install 'verlj[wandb]'; WANDB_MODE=offline works without network)
    wandb_project: Optional[str] = bookkeeping(None)  # the W&B project (default: verlj)

    def validate(self) -> None:
        _positive("logging.log_interval", self.log_interval)
        if self.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError(f"logging.wandb=true needs wandb: {install_hint('wandb')}") from None
        _choice("logging.progress", self.progress, Progress)


@dataclass
class JournalConfig:
    local_dir: Optional[str] = bookkeeping(None)  # node-local dir for the LMDB journal; RUN/journal then receives shipped segments (null = LMDB in RUN/journal)
    ship_max_lag_steps: int = bookkeeping(2)  # with local_dir: training waits while more committed steps than this are unshipped (a lost node costs at most this many)
    segment_fanout: int = bookkeeping(64)  # with local_dir: merge this many shipped segments into one file, and fanout/4 of those into one at each level above (0 = never merge)
    compression_level: int = bookkeeping(1)  # zstd level of each step's samples in the journal (0 = stored uncompressed)
    retain_samples: str = bookkeeping("all")  # all | since_oldest_snapshot | N: keep samples of steps after the oldest kept snapshot (and of the last N steps); headers, metrics and the hash chain always stay
    archive: bool = bookkeeping(False)  # before pruning, write the samples to RUN/rollouts/*.parquet (needs pyarrow: pip install 'verlj[archive]')
    writer_lease_s: float = bookkeeping(60.0)  # the writer renews its claim on the run (RUN/writer) every lease/6 s; a writer on another node that stops renewing for this long may be taken over (one on the same node, as soon as its process is gone)

    def validate(self) -> None:
        _range("journal.ship_max_lag_steps", self.ship_max_lag_steps, 0, 10_000)
        _range("journal.compression_level", self.compression_level, 0, 22)
        if self.segment_fanout != 0:
            _range("journal.segment_fanout", self.segment_fanout, 2, 1_000_000)
        _range("journal.writer_lease_s", self.writer_lease_s, 0.5, 86400.0)
        policy = str(self.retain_samples)
        if policy not in ("all", "since_oldest_snapshot") and not (policy.isdigit() and int(policy) >= 0):
            raise ConfigError("journal.retain_samples must be all, since_oldest_snapshot or a whole number of steps >= 0, "
                              f"got {self.retain_samples!r}")
        if self.archive:
            try:
                import pyarrow.parquet  # noqa: F401
            except ImportError:
                raise ConfigError(f"journal.archive=true needs pyarrow: {install_hint('archive')}") from None
        if self.local_dir is not None and not str(self.local_dir).strip():
            raise ConfigError("journal.local_dir must be a directory path or null")


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        data, ro = self.data, self.rollout
        generated = data.train_dataset == "builtin:add" or data.train_dataset.startswith(REASONING_GYM + ":")
        taskset = data.train_dataset.startswith(VERIFIERS)  # a verifiers taskset's rewards score its episodes
        if taskset != (ro.agent or "").startswith(VERIFIERS) or taskset and ro.agent != data.train_dataset:
            raise ConfigError(f"data.train_dataset and rollout.agent name one verifiers taskset together (its tasks are the rows its "
                              f"harness plays): set both to verifiers:TASKSET; got {data.train_dataset!r} and {ro.agent!r}")
        if ro.reward_fn == "auto" and not (generated or taskset) and ro.env is None:  # with an env, its rewards alone score
            raise ConfigError("rollout.reward_fn: a dataset file has no scorer of its own; name one (builtin:add, or module:function)")
        if ro.reward_fn == REASONING_GYM and not data.train_dataset.startswith(REASONING_GYM + ":"):
            raise ConfigError("rollout.reward_fn=reasoning_gym scores with a reasoning-gym task's own scorer: it needs "
                              "data.train_dataset=reasoning_gym:TASK")
        if self.trainer.eval_interval and data.eval_dataset is None and not (generated and data.eval_size):
            raise ConfigError("trainer.eval_interval needs held-out prompts: set data.eval_size (a generated dataset holds "
                              "them out) or data.eval_dataset (a .jsonl / .parquet file)")
        if self.algorithm.name in ("grpo", "rloo") and self.rollout.n < 2:
            raise ConfigError(f"rollout.n must be at least 2 for {self.algorithm.name} (advantages are relative within a group)")
        if ro.free_running and self.distributed.tensor_parallel_size > 1:
            raise ConfigError("rollout.async_order=completion does not combine with tensor parallelism yet "
                              "(distributed.tensor_parallel_size > 1); use rollout.async_order=step")
        if self.model.actor.lora_rank and self.distributed.tensor_parallel_size > 1:
            raise ConfigError("model.actor.lora_rank does not combine with tensor parallelism yet "
                              "(distributed.tensor_parallel_size > 1); use ZeRO (distributed.zero_stage) instead")
        return self

    def to_dict(self) -> dict:
        """Plain data: each choice as its YAML value. The config's own codec, not a record's (schema.record): read
        back, a key it does not know is refused by name (a user's file), where a record ignores it."""
        return dataclasses.asdict(self, dict_factory=_plain)

    def to_stored(self) -> dict:
        """The config as a run stores it: without the choices that belong to one command (ONE_OFF_KEYS)."""
        return _without_one_off(self.to_dict())

    def hash(self) -> str:
        """Hash of the config that shapes the trained state (bookkeeping keys excluded)."""
        d = self.to_dict()
        for dotted in keys_with_policy(BOOKKEEPING):
            _pop_dotted(d, dotted)
        return blake3.blake3(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- resume policy


def _policies(cls=None, prefix: str = "") -> dict[str, str]:
    """Dotted key -> policy, for every leaf field, as the fields declare it."""
    out = {}
    for f in dataclasses.fields(cls or Config):
        key = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_policies(tp, key + "."))
        else:
            out[key] = f.metadata.get("policy", FIXED)
    return out


POLICIES = _policies()


def policy_of(dotted: str) -> str:
    """The policy of a dotted key, or of the mapping field it lies in (data.reasoning_gym.config.x is
    data.reasoning_gym.config's)."""
    while dotted not in POLICIES and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return POLICIES.get(dotted, FIXED)


def keys_with_policy(policy: str) -> list[str]:
    return [k for k, p in POLICIES.items() if p == policy]


def check_change(old: dict, new: Config, allow_live: bool, how: str) -> list[str]:
    """The dotted keys that differ between a run's config and a new one, if the change is allowed.

    `how` names the operation for the message ("resume", "fork"). Fixed keys are refused always;
    live keys unless `allow_live`; bookkeeping keys pass. Keys added to verlj since the run began
    take their defaults and are not a change. Topology keys pass like bookkeeping ones (and like the
    number of ranks): the snapshot is resharded."""
    changed = _changed(old, new)
    _refuse_fixed(changed, how)
    needs_flag = [k for k in changed if policy_of(k) == LIVE]
    if needs_flag and not allow_live:
        raise ConfigError(
            f"the config differs from the run's in {', '.join(needs_flag)}; these change the trained state, "
            f"so {how} refuses them (pass --allow-config-change to accept and record the change)"
        )
    return changed


def changed_config(old: dict, config_file: str | Path | None, overrides: list[str] | tuple[str, ...], allow_live: bool,
                   how: str) -> tuple[Config, list[str]]:
    """A run's config `old` changed by a command's file and overrides (a resume, a fork): the config and the keys that
    changed, checked by their resume policies (check_change). A key the run fixes is said first, as such, before what
    the changed config would say of itself: `rollout.partial=false` on a partial run is "rollout.partial cannot change",
    not a complaint about the rollout.max_token_staleness the run keeps, which the user never typed."""
    data = _merged(config_file, overrides, old)
    try:
        cfg = config_from_dict(data)
    except ConfigError:
        _refuse_fixed(_changed(old, _build(Config, data)), how)
        raise
    return cfg, check_change(old, cfg, allow_live, how)


def _changed(old: dict, new: Config) -> list[str]:
    return [k for k in diff_configs(config_from_dict(old).to_dict(), new.to_dict()) if k not in ONE_OFF_KEYS]


def _refuse_fixed(changed: list[str], how: str) -> None:
    fixed = [k for k in changed if policy_of(k) == FIXED]
    if fixed:
        instead = (f"start a new run with them (a fork may change live keys such as {keys_with_policy(LIVE)[0]}, and bookkeeping ones)"
                   if how == "fork" else
                   "start a new run (or fork one with `verlj replay RUN --to-step N --fork NEW_RUN` and change only "
                   f"live keys such as {keys_with_policy(LIVE)[0]})")
        they = "they shape" if len(fixed) > 1 else "it shapes"
        raise ConfigError(f"{', '.join(fixed)} cannot change within a run ({how}): {they} the engines, the data or the random "
                          f"streams; {instead}")


# ----------------------------------------------------------------------------- what-if policy

# What `verlj whatif RUN --from-step A -o NEW key=value` may change (loop.whatif): how RUN's journaled
# samples are scored, filtered and trained on, and bookkeeping keys. Any other key would need new
# samples (sampling, lengths, the engine, the model, the data, the seeds) or another state (the
# algorithm's parts, the topology): refused by check_whatif, naming the key.
WHATIF_KEYS = (
    "model.actor.optim.lr", "model.critic.optim.lr",  # the optimizers
    "model.actor.clip_ratio", "model.critic.cliprange_value", "model.actor.entropy_coeff",  # the objective
    "model.actor.clip_ratio_low", "model.actor.clip_ratio_high", "model.actor.loss_mode", "algorithm.loss_agg_mode",
    "algorithm.name",  # the estimator, among those without a critic (check_whatif)
    "model.actor.use_kl_loss", "model.actor.kl_loss_coef", "algorithm.kl_coef",  # the KL term (GRPO: in the loss; PPO: in the rewards)
    "algorithm.loss_normalization", "model.actor.ppo_epochs", "model.actor.mini_batch_size",  # loss aggregation, passes
    "algorithm.norm_adv_by_std", "algorithm.gamma", "algorithm.lam",  # the advantage estimator
    "algorithm.rollout_is_threshold",  # the off-policy correction's truncation
    "rollout.reward_fn", "rollout.answer_format", "model.reward_model.weight",  # the samples are scored again
    "algorithm.dynamic_sampling",  # the zero-variance filter, on the scores given again
)


def check_whatif(old: dict, new: Config) -> list[str]:
    """The dotted keys a what-if changes from `old` (RUN's config), if it may change them (WHATIF_KEYS
    and bookkeeping keys); else one sentence naming the first key it may not."""
    was = config_from_dict(old)
    changed = [k for k in diff_configs(was.to_dict(), new.to_dict()) if k not in ONE_OFF_KEYS]
    check_whatif_keys(changed)
    if "algorithm.name" in changed and "ppo" in (was.algorithm.name, new.algorithm.name):
        raise ConfigError(
            f"algorithm.name cannot change from {was.algorithm.name} to {new.algorithm.name} in a what-if: ppo trains a critic "
            "the others have not; a what-if may change it among grpo, rloo and reinforce_plus_plus"
        )
    return changed


def check_whatif_keys(changed: list[str]) -> None:
    """One sentence naming the first of the `changed` keys a what-if may not change (check_whatif)."""
    refused = [k for k in changed if k not in WHATIF_KEYS and policy_of(k) != BOOKKEEPING]
    if refused:
        raise ConfigError(
            f"{refused[0]} cannot change in a what-if: it re-trains on the run's journaled samples, and this key would need "
            f"new samples or another state (fork the run to change it: `verlj replay RUN --to-step A --fork NEW {refused[0]}=...`)"
        )


def _pop_dotted(d: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d[p]
    d.pop(leaf, None)


# Keys verlj no longer has; a run's stored config may still hold them.
RETIRED_KEYS = ("model.reward_model.save_checkpoint",)
# Keys that choose how one command runs, not what the run is: never stored as the run's config (a
# resume records its trainer.resume_from in the run's lineage), and set back to the default (the
# value here) when read from a run that stored them before this rule.
ONE_OFF_KEYS = {"trainer.resume_from": None, "trainer.max_restarts": 0, "distributed.placement": "pack"}


def _without_one_off(data: dict) -> dict:
    for dotted, default in ONE_OFF_KEYS.items():
        *parents, leaf = dotted.split(".")
        d: Any = data
        for part in parents:
            d = d.get(part) if isinstance(d, dict) else None
        if isinstance(d, dict) and leaf in d:
            d[leaf] = default
    return data
# Keys added with a new default whose absence from a stored config means the old behaviour: a run
# made before the key existed keeps training (and replaying) exactly as it did.
LEGACY_VALUES = {"algorithm.loss_normalization": "micro_batch", "model.tiny.vocab": "digits", "trainer.state_digest": "blake3",
                 "rollout.max_observation_length": 0, "model.actor.optim.fused": False, "model.critic.optim.fused": False}


def stored_config(data: dict) -> dict:
    """A config dict as a run stored it, with retired keys dropped, one-off choices reset and the old
    behaviour of keys added since made explicit (a copy)."""
    data = _without_one_off(json.loads(json.dumps(data)))
    for dotted in RETIRED_KEYS:
        try:
            _pop_dotted(data, dotted)
        except (KeyError, TypeError):
            pass
    for dotted, value in LEGACY_VALUES.items():
        *parents, leaf = dotted.split(".")
        d = data
        for part in parents:
            d = d.setdefault(part, {}) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d.setdefault(leaf, value)
    return data


# ----------------------------------------------------------------------------- checks


def _positive(key, v):
    if v <= 0:
        raise ConfigError(f"{key} must be positive, got {v}")


def _at_least(key, v, lo):
    if v < lo:
        raise ConfigError(f"{key} must be at least {lo}, got {v}")


def _range(key, v, lo, hi):
    if not lo <= v <= hi:
        raise ConfigError(f"{key} must be between {lo} and {hi}, got {v}")


def _plain(items: list[tuple[str, Any]]) -> dict:
    return {k: v.value if isinstance(v, Choice) else v for k, v in items}


def _choice(key, v, allowed: tuple[str, ...] | type[Choice]):
    if isinstance(allowed, type):
        allowed = tuple(m.value for m in allowed)
    if v not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {v!r}")


# ----------------------------------------------------------------------------- building


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}.get(tp, str(tp))


def _coerce(key: str, tp, value):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        lists = [a for a in args if typing.get_origin(a) is list]
        if isinstance(value, list) and lists:  # e.g. str | list[str]: a list is read as the list
            return _coerce(key, lists[0], value)
        return _coerce(key, args[0], value)
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping (e.g. {{drop: 0.1}}), got {value!r}")
        return dict(value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a section (a mapping of keys), got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key} must be a finite number, got {value!r}")
            return number
    elif isinstance(tp, type) and issubclass(tp, Choice):  # read as a string; one of its values becomes that member
        text = _coerce(key, str, value)
        if text in ALIASES.get(tp, {}):
            return ALIASES[tp][text]
        return tp(text) if text in tp._value2member_map_ else text  # another: validate refuses it, naming the values
    elif tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads off / on as booleans
            return "on" if value else "off"
        if isinstance(value, (str, int, float)):  # a number where a name is due: the field's own check says what it takes
            return str(value)
        if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), (str, int, float, type(None))):
            # YAML reads `cmd: python agent.py` (a colon, then a space) as a mapping: the text was meant
            (k, v), = value.items()
            text = f"{k}: {v}" if v is not None else f"{k}:"
            raise ConfigError(f"{key} must be a string, got the mapping {value!r}: YAML reads a colon followed by a space as a "
                              f"mapping; quote the value ({key.rpartition('.')[2]}: \"{text}\" in a file, "
                              f"'{key}=\"{text}\"' on the command line), or write it without the space")
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            allowed = f" (allowed: {', '.join(names)})" if not hint else ""
            raise ConfigError(f"unknown config key {key!r}{hint}{allowed}")
        kwargs[k] = _coerce(key, hints[k], v)
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> dict:
    """'a.b.c=value' -> {'a': {'b': {'c': value}}}, value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. trainer.total_steps=40)")
    dotted, raw = text.split("=", 1)
    dotted = dotted.strip().lstrip("+")
    if not dotted or any(not part for part in dotted.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_config_file(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; name a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML{_yaml_where(e, text)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (trainer:, model:, ...)")
    return data


def _yaml_where(e: yaml.YAMLError, text: str) -> str:
    """' at line N: what' -- PyYAML marks an unclosed bracket at the end of the stream (a line past
    the file's last); the line that opened it is the one to name then."""
    problem, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    if problem is None:
        return ""
    lines = max(1, len(text.splitlines()))
    line = problem.line + 1
    if line > lines and context is not None:
        line = context.line + 1
    what = f": {e.problem}" if getattr(e, "problem", None) else ""
    if getattr(e, "problem", None) == "mapping values are not allowed here":  # `agent: cmd: python a.py`
        what += " (a value holding a colon and a space needs quotes: agent: \"cmd: python agent.py\")"
    return f" at line {min(line, lines)}{what}"


def make_config(config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), base: dict | None = None) -> Config:
    """Default <- base (e.g. a run's stored config) <- config file <- dotted overrides; validated."""
    return config_from_dict(_merged(config_file, overrides, base))


def _merged(config_file: str | Path | None, overrides: list[str] | tuple[str, ...], base: dict | None) -> dict:
    data: dict = dict(base or {})
    if config_file is not None:
        data = _merge(data, load_config_file(config_file))
    for o in overrides:
        data = _merge(data, parse_override(o))
    return data


def _asked(config_file: str | Path | None, overrides: list[str] | tuple[str, ...], section: str, key: str, default):
    """One key as one command asks it: the config file and the overrides, without building the rest."""
    data: dict = load_config_file(config_file) if config_file is not None else {}
    for o in overrides:
        data = _merge(data, parse_override(o))
    return (data.get(section) or {}).get(key, default) if isinstance(data.get(section), dict) else default


def restarts_asked(config_file: str | Path | None, overrides: list[str] | tuple[str, ...]) -> int:
    """trainer.max_restarts as one command asks it: the config file and the overrides (a one-off key,
    never read from a run's stored config), without building the rest of the config."""
    value = _asked(config_file, overrides, "trainer", "max_restarts", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"trainer.max_restarts must be an integer >= 0, got {value!r}")
    return value


def launch_asked(config_file: str | Path | None, overrides: list[str] | tuple[str, ...]) -> tuple[str, str | None]:
    """(distributed.placement, distributed.ray_address) as one command asks them, for `--launcher ray`,
    which places the ranks before any of them reads the run's stored config."""
    placement = _asked(config_file, overrides, "distributed", "placement", "pack")
    _choice("distributed.placement", placement, ("pack", "spread"))
    address = _asked(config_file, overrides, "distributed", "ray_address", None)
    if address is not None and not isinstance(address, str):
        raise ConfigError(f"distributed.ray_address must be a string or null, got {address!r}")
    return placement, address


def config_from_dict(data: dict) -> Config:
    return _build(Config, data).validate()


@typing.overload
def config_from_stored(data: dict, unknown: typing.Literal["raise"] = "raise") -> Config: ...
@typing.overload
def config_from_stored(data: dict | None, unknown: typing.Literal["none"]) -> Config | None: ...
def config_from_stored(data: dict | None, unknown: str = "raise") -> Config | None:
    """A config a run stored (`stored_config` applied) as types, for reading only: not validated again
    (it was when the run started; what validation imports, pyarrow or wandb, may be missing where it is read).
    A key this verlj does not know (a newer release's run): ConfigError, or with unknown="none", None
    (as for no config at all: post-mortem readers that can do without it)."""
    if unknown == "none":
        try:
            return config_from_stored(data) if data else None
        except ConfigError:
            return None
    assert data is not None
    return _build(Config, stored_config(data))


def to_yaml(cfg: Config, stored: bool = False) -> str:
    """The config as YAML (stored=True: as the run keeps it, without one-off choices)."""
    return yaml.safe_dump(cfg.to_stored() if stored else cfg.to_dict(), sort_keys=False)


def diff_configs(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = []
    for k in sorted(set(old) | set(new)):
        dotted = f"{prefix}.{k}" if prefix else k
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += diff_configs(a, b, dotted)
        elif a != b:
            keys.append(dotted)
    return keys

