"""The training loop: each step is ``collect`` then ``apply``, journaled in one transaction.

    verlj train --output-dir runs/demo                                   # built-in default
    torchrun --nproc_per_node 2 -m verlj.cli train --output-dir runs/dp2 distributed.zero_stage=3

``collect(step)`` is the expensive, stochastic half: draw prompts, generate, score, decide what
enters, leaves and is consumed from the rollout buffer. It returns :class:`StepInputs`, which is
exactly what the journal records. ``apply(step, inputs)`` is the deterministic half: log-probs,
advantages, DeepSpeed updates, metrics, fingerprint. Replay (``verlj replay``, ``--resume``) feeds
``apply`` the inputs read back from the journal, so it never generates or scores, and cannot drift
from training because it is the same code.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from verlj.journal import StepRecord
from verlj.journal.failpoints import failpoint

from ..config import Config, ConfigError
from ..dist import Runtime
from ..errors import ModelError, ReplayError, RunError
from ..schema import events as ev
from ..schema.sample import GroupInFlight
from ..state.fingerprint import fingerprint as state_fingerprint
from ..state.fingerprint import state_leaves
from ..state.seeding import derive_seed, rng_digest, seed_globals
from ..state.stage_recorder import StageRecorder
from ..state.stages import combine
from ..state.stateful import check_version
from . import algorithms, faults
from . import samples as sample_codec
from .buffer import RolloutBuffer
from .data import Example, Sampler, check_identity, load_data
from .envs import load_env, row_of
from .episodes import InFlightLog, Limits, Play, Round
from .models import BUILTIN_TINY, ValueModel, load_causal_lm, load_reward_model, load_tokenizer, model_digest, render_chat
from .rewards import load_reward_fn, reward_model_scores, scored_or_faults
from .rollout import RolloutEngine, make_engine
from .sampler import sample_seeded, sampling_params
from .samples import Columns, EnvEnd, Sample
from .tasks import TaskScorer
from .workers import ActorWorker, CriticWorker, collate, shard_batch


@dataclass
class StepInputs:
    """Everything `apply` needs that `collect` produced: the journal's record of a step's inputs.

    The batches generated this step (`added`, `dropped`, the dataset rows drawn) and what the step
    trains on (`consumed`). Sync mode generates the step's own batch; async mode the batch of step
    s+k (the first step: of steps 1..k+1), with `plans` saying which samples that step will train on."""

    seeds: dict[str, int]
    data: ev.Data  # the dataset rows drawn this step (all rounds) and the sampler's place after them
    added: dict  # the samples generated this step, columnar (schema.sample.pack)
    dropped: np.ndarray  # ids dropped (zero-variance groups)
    consumed: np.ndarray  # ids the update trains on, in order
    rollout: ev.Rollout  # the engine that generated, the rollout mode, a what-if's correction
    timings: dict[str, float] = field(default_factory=dict)  # collect's own metrics (timings, sampling)
    plans: dict[int, np.ndarray] = field(default_factory=dict)  # async: step -> the ids it will train on
    stale: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # async: ids dropped as too stale for any later step
    requests: ev.Requests | None = None  # completion order: the groups and rows asked, and those asked again
    faulted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # ids out of the update for a fault (rl.faults)
    admitted: bool = False  # live: collect has put the batches into the buffer already (not journaled)

    def events(self) -> list[dict]:
        out = [
            self.data.to_event(),
            self.rollout.to_event(),
            ev.Rng(self.seeds, rng_digest()).to_event(),
            ev.Added(Columns(self.added).ids, self.added).to_event(),
            ev.Dropped(self.dropped, ev.DropReason.ZERO_VARIANCE).to_event(),
            ev.Consumed(self.consumed).to_event(),
        ]
        if len(self.faulted):  # only then: a record without faults keeps its bytes
            out.append(ev.Dropped(self.faulted, ev.DropReason.FAULT).to_event())
        if self.rollout.is_async:
            out.append(ev.Dropped(self.stale, ev.DropReason.STALE).to_event())
            if self.rollout.completion_order:
                out.append((self.requests or ev.Requests()).to_event())
            else:
                out.append(ev.Plan.of(self.plans).to_event())
        return out

    @classmethod
    def from_record(cls, record: StepRecord) -> StepInputs:
        """A journaled step's inputs, as `apply` takes them (replay)."""
        step = ev.StepEvents.of(record)
        data, rng, added, consumed = step.require_inputs()
        if added.samples is None:
            raise ReplayError(f"step {record.step}'s samples were pruned from the journal (journal.retain_samples); it cannot be replayed")
        return cls(
            seeds=dict(rng.seeds),
            data=data,
            added=added.samples,
            dropped=step.dropped(ev.DropReason.ZERO_VARIANCE),
            stale=step.dropped(ev.DropReason.STALE),
            consumed=consumed.ids,
            rollout=step.rollout or ev.Rollout("hf", None),
            plans=step.plan.plans() if step.plan is not None else {},
            requests=step.requests,
            faulted=step.dropped(ev.DropReason.FAULT),
        )


@dataclass
class Production:
    """One step's batch being generated: its rounds (dynamic sampling may need several), the samples
    and drops so far, and, once finished, the plan (the ids that step will train on)."""

    step: int  # the step that will train on it (its samples' seeds are their places in that step)
    version: int  # the policy version generating it
    pending_groups: int  # valid groups already waiting (carried over, unplanned, fresh enough)
    next_id: int
    stale: list = field(default_factory=list)  # async: waiting groups too old for this step, and so for any later one
    drawn: list = field(default_factory=list)
    added: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    faulted: list = field(default_factory=list)  # ids out of the update for a fault (rl.faults)
    rounds: int = 0
    handle: object = None  # the round in flight (RolloutEngine.submit)
    gen_s: float = 0.0  # time the trainer spent generating or waiting for generation
    mine: np.ndarray | None = None
    prompts: list = field(default_factory=list)
    plan: np.ndarray | None = None
    places: list = field(default_factory=list)  # this rank's samples' places q in the round (their seeds')
    episodes: Round | None = None  # rollout.env: the round's episodes being played
    first: list = field(default_factory=list)  # rollout.env: the episodes whose turn 0 was asked (those whose reset did not fault)


@dataclass
class Flow:
    """Completion order: what one step's collect saw of the free-running generator."""

    asked: list = field(default_factory=list)  # (group, row) asked this step, in order
    regenerated: list = field(default_factory=list)  # groups asked again: in flight when the last process stopped
    restored_turns: int = 0  # rollout.env: env steps re-applied to bring groups of episodes back from their last durable turn
    added: list = field(default_factory=list)  # samples arrived, in arrival order
    dropped: list = field(default_factory=list)  # ids of zero-variance groups (dynamic sampling)
    stale: list = field(default_factory=list)  # ids of waiting groups more than k versions behind
    faulted: list = field(default_factory=list)  # ids out of the update for a fault (rl.faults)
    rounds: int = 0  # rounds of prompts_per_step prompts asked


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
    def timed(self, name: str):
        """The block's wall time, as the timing metric `name`."""
        t = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - t

    @contextmanager
    def staging(self):
        """The stage recorder, the block's time counted as digesting stages (timing_s/stages)."""
        t = time.perf_counter()
        yield self.rec
        self.stage_s += time.perf_counter() - t


ARRIVAL_POLL_S = 0.5  # completion order: how long one wait for the generator's groups lasts before the ranks compare


def is_timing(name: str) -> bool:
    return name.startswith("timing_s/")


class Trainer:
    """Holds the run's Stateful parts: actor (+ reference), critic, sampler, rollout buffer."""

    keep_stages = False  # a re-execution for `verlj diff --stages` keeps every stage's values (StepOutcome.kept)

    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
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
        self.reward_fn = self._reward_fn(cfg)
        # the eval pass scores with the task's own scorer (reasoning-gym), else with the rule reward
        self.eval_scorer = TaskScorer(self.data.task_dataset, cfg.rollout.answer_format) if self.data.task_dataset is not None else None
        self.rm = None
        self.rm_digest = None
        if cfg.model.reward_model.model_name_or_path:
            model, tok = load_reward_model(cfg.model.reward_model.model_name_or_path)
            self.rm_digest = model_digest(cfg.model.reward_model.model_name_or_path)
            self.rm = (model.to(rt.device).eval(), tok)
            for p in self.rm[0].parameters():
                p.requires_grad_(False)
        actor_model = load_causal_lm(cfg.model.actor.model_name_or_path, cfg, derive_seed(seed, 0, "init/actor"))
        self.actor = ActorWorker(actor_model, cfg, rt)
        self.rollout: RolloutEngine | None = None  # built by the first live collect (replay never generates)
        self._env_factory = None  # rollout.env's, made by the first live collect (replay never plays an episode)
        self._inflight: Production | None = None  # async: the batch generating while the update runs
        self._flow: Flow | None = None  # completion order: this step's arrivals and asks
        self._resumed_asks = False  # completion order: the groups asked and not arrived were asked again of this process's generator
        # completion order with rollout.env (rl.episodes): the groups of episodes this rank asked for, being played;
        # where they are made durable (set by loop.run for live training); those durable from before this process
        # (read at its first collect); restored ones already over; groups in a committed step, to forget
        self._plays: dict[int, Play] = {}
        self.in_flight_log: InFlightLog | None = None
        self._durable: dict[int, GroupInFlight] = {}
        self._over: list[int] = []
        self._settle: list[int] = []
        self.critic = None
        if cfg.algorithm.name == "ppo":
            path = cfg.model.critic.model_name_or_path or cfg.model.actor.model_name_or_path
            backbone = load_causal_lm(path, cfg, derive_seed(seed, 0, "init/critic"), key="model.critic.model_name_or_path")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, 0, "init/value_head"))
                value_model = ValueModel(backbone)
            self.critic = CriticWorker(value_model, cfg, rt)

    def identity(self) -> dict:
        """What the trainer loaded that the config alone does not pin: the prompts (a file's rows, a
        reasoning-gym task's generated ones and its version) and the frozen reward model's files."""
        return {"reward_model_digest": self.rm_digest, "dataset": self.data.identity}

    def check_identity(self, recorded) -> None:
        """On resume: the prompts and the frozen reward model must be the ones the run started with.
        `recorded`: what the run's identity says was loaded (loop.ledger.Loaded: dataset, reward_model_digest)."""
        check_identity(recorded.dataset, self.data.identity)
        want = recorded.reward_model_digest
        if want is not None and want != self.rm_digest:
            raise ModelError(
                f"model.reward_model.model_name_or_path: the files in {self.cfg.model.reward_model.model_name_or_path} differ "
                "from the reward model this run started with; restore them, or fork the run into a new one"
            )

    def set_config(self, cfg: Config) -> None:
        """Switch to another config of the same run (its live keys may differ: config.check_change)."""
        if (cfg.rollout.reward_fn, cfg.rollout.answer_format) != (self.cfg.rollout.reward_fn, self.cfg.rollout.answer_format):
            self.reward_fn = self._reward_fn(cfg)
            if self.eval_scorer is not None:
                self.eval_scorer.answer_format = cfg.rollout.answer_format
        if (cfg.rollout.env, cfg.rollout.max_turns) != (self.cfg.rollout.env, self.cfg.rollout.max_turns):
            self._env_factory = None
        if self.rollout is not None and cfg.rollout.engine != self.rollout.name:
            self.rollout.close()
            self.rollout = None
            self._resumed_asks = False  # a new generator: what the old one was asked must be asked again
        self.cfg = cfg
        self.actor.set_config(cfg)
        if self.critic is not None:
            self.critic.set_config(cfg)

    def _reward_fn(self, cfg: Config):
        return load_reward_fn(cfg.rollout.reward_fn, cfg.data.train_dataset, self.data.task_dataset, cfg.rollout.answer_format)

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

    def close(self, at_once: bool = False) -> None:
        """Release the rollout and DeepSpeed engines (hooks, buffers, threads) so a process can build another run.
        `at_once`: the user asked to stop now; nothing in flight is waited for."""
        if self.rollout is not None:
            self.rollout.close(at_once)
            self.rollout = None
        for engine in self.engines().values():
            engine.destroy()
        self.actor = self.critic = None

    def param_layout(self) -> dict[str, dict[str, tuple]]:
        """{engine: {parameter: whole shape}} of what each engine trains (state.reshard)."""
        return {"actor": self.actor.full_shapes, **({"critic": self.critic.full_shapes} if self.critic is not None else {})}

    def weights_changed(self) -> None:
        """The actor's weights changed (an update, a snapshot load): the rollout engine must catch up."""
        if self.rollout is not None:
            self.rollout.weights_changed()

    def engines(self) -> dict:
        return {"actor": self.actor.engine, **({"critic": self.critic.engine} if self.critic is not None else {})}

    def fingerprint(self) -> tuple[str, dict[str, str]]:
        """The fingerprint of the trained state now (every engine's, of trainer.state_digest's kind)
        and its parts by engine. Collective."""
        return state_fingerprint(self.engines(), self.rt, self.cfg.trainer.state_digest)

    # ================================================================== collect: stochastic, expensive

    def collect(self, step: int) -> StepInputs:
        """The stochastic, expensive half of a step: draw prompts, generate `rollout.n` samples for each
        (each from its own seed: its place in the step that trains on it), score them, and decide what
        enters, leaves and is consumed from the rollout buffer (dynamic sampling may draw more
        rounds). Changes the sampler and the buffer, nothing the update reads; returns exactly what
        the journal records. Live steps only: replay reads these inputs back instead. Collective.

        Sync mode generates the step's own batch from the policy the step starts from (version s-1).
        Async mode (k = rollout.max_staleness) has the batch of step s planned already; it starts
        generating the batch of step s+k from version s-1 (k = 1: verl's one-step-off-policy), which
        `finish_collect` waits for once the update is done. Step 1 first generates batches 1..k (all
        from version 0: the staleness of step s is min(k, s-1)). Completion order: see `_collect_free`."""
        cfg, rt = self.cfg, self.rt
        k = cfg.rollout.staleness
        seeds = {
            "rollout": derive_seed(cfg.trainer.seed, step, "rollout"),
            "train": derive_seed(cfg.trainer.seed, step, "train"),
        }
        seed_globals(derive_seed(cfg.trainer.seed, step, "globals"))
        t = time.perf_counter()
        if self.rollout is None:
            self.rollout = make_engine(cfg.rollout.engine, rt, self.actor, self.tokenizer, cfg.rollout.mode)
        version = self.train_state.step  # the update of the last step trained made the actor's weights
        self.rollout.sync(cfg, version)  # vLLM, the async generator: started at the first live step, then the last update pushed
        timings = {"timing_s/weight_sync": time.perf_counter() - t, "timing_s/gen": 0.0, "timing_s/reward": 0.0}
        made: list[Production] = []
        if cfg.rollout.free_running:
            self._made, self._timings, self._seeds = made, timings, seeds
            self._consumed = self._collect_free(step, timings)
            return self._inputs()
        if k == 0:
            made.append(self._admit(self._finish(self._start(step, version), timings), planned=False))
            consumed = made[0].plan
        else:
            through = self.buffer.planned_through() or step - 1
            for j in range(through + 1, step + k):  # only at the run's first step: batches 2..k wait for no update
                made.append(self._admit(self._finish(self._start(j, version), timings), planned=True))
            self._inflight = self._start(step + k, version) if through < step + k else None
            consumed = self.buffer.plans[step]
        self._made, self._consumed, self._timings, self._seeds = made, consumed, timings, seeds
        return self._inputs()

    def finish_collect(self, step: int, inputs: StepInputs) -> StepInputs:
        """Async mode, after the update: wait for the batch `collect` started, score it, admit it and
        plan it; the step's inputs then include it. Completion order: push the new weights (the
        generator pauses at a batch's boundary first) and take in what arrived. Sync mode: `inputs` as
        they are. Collective."""
        if self.cfg.rollout.free_running:
            t = time.perf_counter()
            self.rollout.sync(self.cfg, step)  # before the commit: a group in flight at a crash began from a committed version
            _add_time(self._timings, "timing_s/weight_sync", time.perf_counter() - t)
            self._receive(0.0)
            return self._inputs()
        if self._inflight is None:
            return inputs
        self._made.append(self._admit(self._finish(self._inflight, self._timings), planned=True))
        self._inflight = None
        return self._inputs()

    def _inputs(self) -> StepInputs:
        if self.cfg.rollout.free_running:
            return self._flow_inputs()
        made, cfg = self._made, self.cfg
        added = [s for p in made for s in p.added]
        drawn = [i for p in made for i in p.drawn]
        self._timings.update({"sampling/rounds": float(sum(p.rounds for p in made)),
                              "sampling/dropped_groups": float(sum(len(p.dropped) for p in made) // cfg.rollout.n)})
        self._timings.update(faults.metrics(added))
        if cfg.rollout.env is not None:
            self._timings.update(_episode_metrics(added))
        async_mode = cfg.rollout.mode == "async"
        mode = ev.RolloutMode.ASYNC if async_mode else ev.RolloutMode.SYNC
        return StepInputs(
            seeds=self._seeds,
            data=ev.Data(self.sampler.epoch, self.sampler.cursor, np.concatenate(drawn) if drawn else np.zeros(0, np.int64),
                         sum(p.rounds for p in made)),
            added=sample_codec.pack(added),
            dropped=np.asarray([i for p in made for i in p.dropped], dtype=np.int64),
            consumed=self._consumed,
            timings=self._timings,
            rollout=ev.Rollout(self.rollout.name, self.rollout.version, mode, cfg.rollout.staleness if async_mode else None),
            plans={p.step: p.plan for p in made} if async_mode else {},
            stale=np.asarray([i for p in made for i in p.stale], dtype=np.int64),
            faulted=np.asarray([i for p in made for i in p.faulted], dtype=np.int64),
            admitted=True,
        )

    def _start(self, step: int, version: int) -> Production:
        """Begin generating the batch of `step` from the actor's weights (policy `version`)."""
        want = max(0, step - 1 - self.cfg.rollout.staleness)
        if want != version:  # collect's schedule guarantees it; a broken invariant must not train silently
            raise RunError(f"the batch of step {step} must come from policy version {want} but the actor holds version {version}")
        waiting = self.buffer.groups()
        stale = []
        if self.cfg.rollout.staleness:  # async: a step trains on no sample more than k versions behind it
            stale = [ids for ids in waiting.values() if self.buffer.samples[ids[0]].policy_version < want]
        prod = Production(step=step, version=version, pending_groups=len(waiting) - len(stale), next_id=self.buffer.next_id,
                          stale=[i for ids in stale for i in ids])
        self._submit_round(prod)
        return prod

    def _submit_round(self, prod: Production) -> None:
        cfg, rt = self.cfg, self.rt
        prompts_per_step, group_size, dp_size = cfg.data.prompts_per_step, cfg.rollout.n, rt.dp_size
        indices = self.sampler.draw(prompts_per_step)
        prod.drawn.append(indices)
        first = rt.dp_rank * (prompts_per_step // dp_size)  # this rank's prompts are the step's first+0, first+1, ...
        prod.mine = indices[first : first + prompts_per_step // dp_size]
        prod.prompts = [self.prompt_ids[i] for i in prod.mine for _ in range(group_size)]
        # each sample's seed is its place in its step (round, k), whichever rank generates it
        prod.places = list(range(first * group_size, first * group_size + len(prod.prompts)))
        sample_seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/sample", prod.rounds, q) for q in prod.places]
        t = time.perf_counter()
        prompts = prod.prompts
        if cfg.rollout.env is not None:  # episodes: each env reset from its sample's place (rl.episodes)
            rows = [row_of(self.dataset[int(i)]) for i in prod.mine for _ in range(group_size)]
            env_seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/env", prod.rounds, q) for q in prod.places]
            prod.episodes = Round(self._envs(), rows, env_seeds, prod.prompts, self.tokenizer, Limits.of(cfg.rollout))
            prompts, prod.first = prod.episodes.first_prompts(), prod.episodes.live()  # a reset that faulted: no action
            prompts, sample_seeds = [prompts[i] for i in prod.first] or prompts[:1], [sample_seeds[i] for i in prod.first] or [0]
        prod.handle = self.rollout.submit(prompts, sample_seeds, cfg)
        prod.gen_s += time.perf_counter() - t

    def _envs(self):
        """rollout.env's factory (made at the first live collect that plays episodes)."""
        if self._env_factory is None:
            self._env_factory = load_env(self.cfg, self.data.task_dataset)
        return self._env_factory

    def _play(self, prod: Production, responses, logps) -> None:
        """Play the round's episodes to their ends from turn 0's actions: turn t of every episode still
        going is generated together (its context so far as the prompt, its own seed). Collective: the
        ranks generate each turn together while any rank has an episode going."""
        cfg, rt, eps = self.cfg, self.rt, prod.episodes
        places = prod.first  # turn 0 was asked of these (_submit_round); a stand-in prompt when none
        responses, logps = (responses, logps) if places else ([], [])
        while True:
            eps.take(places, responses, logps)
            if rt.all_true(eps.done()):
                return
            places = [] if eps.done() else eps.live()
            contexts = [eps.episodes[i].context() for i in places]
            seeds = [derive_seed(cfg.trainer.seed, prod.step, "rollout/sample", prod.rounds, prod.places[i], eps.turn) for i in places]
            if not places:  # this rank's episodes are over, another rank's are not: step with it, keep nothing
                contexts, seeds = [eps.episodes[0].context()], [0]
            responses, logps = self.rollout.result(self.rollout.submit(contexts, seeds, cfg))
            if not places:
                responses, logps = [], []

    def _finish(self, prod: Production, timings: dict) -> Production:
        """Wait for the round in flight, score it, and draw more rounds while dynamic sampling needs
        them; then plan what the batch's step trains on."""
        cfg, rt = self.cfg, self.rt
        prompts_per_step, group_size = cfg.data.prompts_per_step, cfg.rollout.n
        while True:
            t0 = time.perf_counter()
            responses, logps = self.rollout.result(prod.handle)
            if prod.episodes is not None:
                self._play(prod, responses, logps)
            t1 = time.perf_counter()
            if prod.episodes is not None:
                local = self._score_episodes(prod.mine, group_size, prod.episodes)
            else:
                local = self._score(prod.mine, group_size, prod.prompts, responses, logps)
            for s in local:
                s.policy_version = prod.version
            prod.gen_s += t1 - t0
            _add_time(timings, "timing_s/reward", time.perf_counter() - t1)
            t2 = time.perf_counter()
            self._reference_logprobs(local)
            _add_time(timings, "timing_s/ref", time.perf_counter() - t2)
            # every rank gets every sample; TP peers generated the same ones, keep one copy per DP rank
            gathered = rt.all_gather_obj(sample_codec.pack(local))
            new = [s for r, cols in enumerate(gathered) if r % rt.tp_size == 0 for s in sample_codec.unpack(cols)]
            for q, s in enumerate(new):
                s.id = prod.next_id + q
                s.group = prod.next_id + (q // group_size) * group_size  # a group is named by its first sample's id
            prod.next_id += len(new)
            prod.added += new
            prod.rounds += 1
            out = faults.excluded(new, faults.min_group(cfg.algorithm.name, group_size))
            prod.faulted += out
            if not cfg.algorithm.dynamic_sampling:
                break
            flat = _zero_variance(new, set(out))
            prod.dropped += flat
            gone = set(out) | set(flat)
            prod.pending_groups += len({s.group for s in new if s.id not in gone})
            if prod.pending_groups >= prompts_per_step or prod.rounds >= cfg.algorithm.max_sampling_rounds:
                break
            self._submit_round(prod)
        _add_time(timings, "timing_s/gen", prod.gen_s)  # async: only the wait the update did not cover
        prod.plan = self._choose_consumed(prod.added, set(prod.dropped) | set(prod.stale) | set(prod.faulted))
        return prod

    def _admit(self, prod: Production, planned: bool) -> Production:
        """A finished batch enters the buffer (async: with its plan); only then may a step count on it."""
        self.buffer.admit(prod.added, [*prod.dropped, *prod.stale, *prod.faulted], {prod.step: prod.plan} if planned else {})
        if planned:
            failpoint("async.admit")
        return prod

    def _rewards(self, rows: list[int], prompts, responses, model: bool = True,
                 scored=None) -> tuple[list[float], list[float] | None, list[str]]:
        """(rule rewards, reward model scores: None when `model` is false or there is no reward model,
        each rule reward's fault: "" none, else the sample's: rl.faults) of each response to the prompt
        of dataset row `rows[k]`. `scored`: the texts the rule reward scores instead of the responses'
        (an episode's: its last action)."""
        tok = self.tokenizer
        texts_p = [tok.decode(p, skip_special_tokens=True) for p in prompts]
        texts_r = [tok.decode(r, skip_special_tokens=True) for r in responses]
        rule, faulted = scored_or_faults(self.reward_fn, texts_p, texts_r if scored is None else scored, [self.dataset[i] for i in rows])
        rm = None
        if model and self.rm is not None:
            rm = reward_model_scores(self.rm[0], self.rm[1], [p + r for p, r in zip(texts_p, texts_r)], self.rt.device)
        return rule, rm, faulted

    def rescore(self, samples: list[Sample], model: bool = False) -> None:
        """`verlj rerun`, what-ifs: score journaled samples again, in place, with the reward function the
        config names now (and the reward model with `model`; else its journaled scores are kept), as
        collect scored them: score = rule_reward + weight * rm_score. Reads, generates nothing."""
        if not samples:
            return
        tok, named = self.tokenizer, self.reward_fn_named()
        scored = [tok.decode(s.turns()[-1].action_ids, skip_special_tokens=True) if s.is_episode else tok.decode(s.response_ids, skip_special_tokens=True)
                  for s in samples]
        rule, rm, faulted = self._rewards([int(s.index) for s in samples], [s.prompt_ids for s in samples],
                                          [s.response_ids for s in samples], model, scored)
        w = self.cfg.model.reward_model.weight
        for k, s in enumerate(samples):
            s.rule_reward = (s.env_score() + (rule[k] if named else 0.0)) if s.is_episode else rule[k]
            s.fault = faulted[k] if named or not s.is_episode else ""
            if rm is not None:
                s.rm_score = rm[k]
            s.score = s.rule_reward + w * s.rm_score

    def reward_fn_named(self) -> bool:
        """Whether the config names rollout.reward_fn (anything but `auto`): an episode's score then adds
        its rule reward to the env's rewards; with `auto` the env's rewards alone score an episode."""
        return self.cfg.rollout.reward_fn != "auto"

    def _score_episodes(self, mine, group_size, eps: Round) -> list[Sample]:
        """An episode's score: the env's rewards summed over its turns (turns without one count 0), plus
        the rule reward of its last action when rollout.reward_fn is named (reward_fn_named), plus the
        reward model's weighted score of the whole episode."""
        rows = [int(i) for i in mine for _ in range(group_size)]
        fields = [eps.fields(k) for k in range(len(rows))]
        named = self.reward_fn_named()
        rule, rm, faulted = [0.0] * len(rows), None, [""] * len(rows)
        if named or self.rm is not None:
            rule, rm, faulted = self._rewards(rows, [ep.prompt_ids for ep in eps.episodes[: len(rows)]],
                                     [np.asarray(ep.response, np.int64) for ep in eps.episodes[: len(rows)]],
                                     scored=[ep.last_action for ep in eps.episodes])
        rm = rm or [0.0] * len(rows)
        w = self.cfg.model.reward_model.weight
        out = []
        for k, f in enumerate(fields):
            reward = eps.env_score(k) + (rule[k] if named else 0.0)
            out.append(Sample(index=rows[k], id=0, group=0, score=reward + w * rm[k], rule_reward=reward, rm_score=rm[k],
                              fault=faulted[k] if named else "", **f))
        return out

    def _score(self, mine, group_size, prompts, responses, logps) -> list[Sample]:
        rows = [int(i) for i in mine for _ in range(group_size)]
        rule, rm, faulted = self._rewards(rows, prompts, responses)
        rm = rm or [0.0] * len(rule)
        w = self.cfg.model.reward_model.weight
        return [Sample(index=rows[k], prompt_ids=prompts[k], response_ids=responses[k], gen_logprobs=logps[k], id=0, group=0,
                       score=rule[k] + w * rm[k], rule_reward=rule[k], rm_score=rm[k], fault=faulted[k]) for k in range(len(prompts))]

    def needs_reference(self) -> bool:
        cfg = self.cfg
        return (cfg.algorithm.name == "grpo" and cfg.model.actor.use_kl_loss) or cfg.algorithm.kl_coef > 0

    def _reference_logprobs(self, samples: list[Sample]) -> None:
        """The frozen reference's log-probs of each response, computed once at collect time and
        journaled with the sample: they depend on nothing the update changes, so replay reads them."""
        if not samples:
            return
        if not self.needs_reference():
            for s in samples:
                s.ref_logprobs = np.zeros(0, dtype=np.float32)
            return
        batch = collate(samples, self.tokenizer.pad_token_id, self.rt.device)
        ref = self.actor.logprobs(batch, model=self.actor.ref).float().cpu().numpy()
        for i, s in enumerate(samples):
            s.ref_logprobs = ref[i, : len(s.response_ids)].astype(np.float32)

    def _choose_consumed(self, added: list[Sample], dropped: set[int]) -> np.ndarray:
        """The first prompts_per_step valid groups in arrival order (carried-over ones first),
        trimmed so every data-parallel rank gets the same number of samples. `dropped`: ids that may not
        be chosen (zero-variance groups, and in async mode waiting groups too stale)."""
        order: dict[int, list[int]] = {g: ids for g, ids in self.buffer.groups().items() if ids[0] not in dropped}
        for s in added:
            if s.id not in dropped:
                order.setdefault(s.group, []).append(s.id)
        groups, dp = list(order.values())[: self.cfg.data.prompts_per_step], self.rt.dp_size
        while groups and sum(map(len, groups)) % dp:  # groups of unequal sizes (faults left out): the last one whose going evens it
            total = sum(map(len, groups))
            k = next((k for k in reversed(range(len(groups))) if (total - len(groups[k])) % dp == 0), len(groups) - 1)
            del groups[k]
        return np.asarray([i for g in groups for i in g], dtype=np.int64)

    # ================================================================== async, completion order

    def _collect_free(self, step: int, timings: dict) -> np.ndarray:
        """rollout.async_order=completion: the generator works through the groups asked of it on its
        own; the step takes the first prompts_per_step groups that have arrived, in arrival order,
        dropping those more than k versions behind it. Arrivals enter the buffer (and this step's
        record) as they come; the step asks for more when what waits and what is asked cannot fill
        it, then asks for the next k rounds, which generate while it trains. A process's first step
        asks again for every group the journal shows asked and not arrived (in flight when the last
        process stopped), from its original seeds. Collective."""
        cfg, P = self.cfg, self.cfg.data.prompts_per_step
        if self._flow is not None and cfg.rollout.env is not None:  # its groups are in the step committed since
            self._settle += sorted({int(s.group) for s in self._flow.added})
        self._flow = flow = Flow()
        if not self._resumed_asks:
            flow.regenerated = list(self.buffer.requests)
            if cfg.rollout.env is not None:
                self._durable = self._durable_groups()
            self._ask(list(self.buffer.requests.items()))
            self._resumed_asks = True
        oldest = max(0, step - 1 - cfg.rollout.staleness)
        wait = 0.0
        while True:
            self._receive(wait)
            stale = [i for ids in self.buffer.groups().values() if self.buffer.samples[ids[0]].policy_version < oldest for i in ids]
            self.buffer.drop(stale)
            flow.stale += stale
            waiting = len(self.buffer.groups())
            if waiting >= P:
                break
            if waiting + len(self.buffer.requests) < P and flow.rounds < cfg.algorithm.max_sampling_rounds:
                self._ask_round(step)
            elif not self.buffer.requests:
                break  # dynamic sampling drew its rounds: the step trains on what it has
            wait = ARRIVAL_POLL_S if self.rt.world_size == 1 else ARRIVAL_POLL_S / 10  # ranks gather as often
        consumed = self._choose_consumed([], set())
        ahead = len(self.buffer.groups()) - len({int(self.buffer.samples[int(i)].group) for i in consumed})
        while ahead + len(self.buffer.requests) + P <= cfg.rollout.staleness * P:  # k rounds ahead
            self._ask_round(step)
        return consumed

    def _ask_round(self, step: int) -> None:
        """Draw prompts_per_step prompts and ask the generator for their groups: each group's samples
        get their ids now, and their seeds from the group's id."""
        cfg, n = self.cfg, self.cfg.rollout.n
        rows = self.sampler.draw(cfg.data.prompts_per_step)
        groups = [self.buffer.next_id + q * n for q in range(len(rows))]
        self.buffer.request(groups, rows, n)
        self._flow.asked += list(zip(groups, rows.tolist()))
        self._flow.rounds += 1
        self._ask(list(zip(groups, rows.tolist())))

    def _ask(self, groups: list[tuple[int, int]]) -> None:
        """Ask this rank's generator for its share of `groups` (group, row): the q-th goes to rank q mod dp.
        With rollout.env, each group's episodes begin (or come back from their last durable turn) here,
        and what is asked is their turn."""
        cfg, n, dp = self.cfg, self.cfg.rollout.n, self.rt.dp_size
        mine = [(g, r) for q, (g, r) in enumerate(groups) if q % dp == self.rt.dp_rank]
        if cfg.rollout.env is not None:
            asks = [self._begin_play(g, r) for g, r in mine]
            self.rollout.ask([a for a in asks if a is not None], cfg, max(1, cfg.data.prompts_per_step // dp))
            return
        self.rollout.ask([(g, self.prompt_ids[r], [derive_seed(cfg.trainer.seed, 0, "rollout/group", g, j) for j in range(n)])
                          for g, r in mine], cfg, max(1, cfg.data.prompts_per_step // dp))

    # ------------------------------------------------------------------ completion order: episodes (rl.episodes)

    def _durable_groups(self) -> dict[int, GroupInFlight]:
        """The groups of episodes made durable by an earlier process, each as it stood after its last turn
        generated from a committed version (a turn from the weights of a step that never committed is
        made again): those still asked, and those asked in a step that never committed, which this
        process asks again under the same ids when it draws the same rows (`_begin_play` checks the row).
        The rest are forgotten at the next write. Collective."""
        if self.in_flight_log is None:
            return {}
        version, out = self.train_state.step, {}
        for g, state in self.in_flight_log.read().items():
            kept = state.before(sum(v <= version for v in state.versions)) if g in self.buffer.requests or g >= self.buffer.next_id else None
            if kept is None:
                self._settle.append(g)
            else:
                out[g] = kept
        return out

    def _begin_play(self, g: int, row: int):
        """A group's episodes begin (each env reset from its place: rl.episodes), or come back from their
        last durable turn; returns what to ask of the generator (None: the group is over already)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        rows = [row_of(self.dataset[int(row)])] * n
        durable = self._durable.pop(g, None)
        if durable is not None and durable.row != int(row):  # another prompt under that id: not this group's turns
            self._settle.append(g)
            durable = None
        if durable is None:
            env_seeds = [derive_seed(cfg.trainer.seed, 0, "rollout/env", g, j) for j in range(n)]
            play = Play(Round(self._envs(), rows, env_seeds, [self.prompt_ids[row]] * n, self.tokenizer, Limits.of(cfg.rollout)), int(row))
        else:
            rnd, replayed = Round.restored(self._envs(), rows, durable, self.tokenizer, Limits.of(cfg.rollout))
            play = Play(rnd, int(row), list(durable.versions))
            self._flow.restored_turns += replayed
        self._plays[g] = play
        return self._next_turn(g, play)

    def _next_turn(self, g: int, play: Play):
        """The group's next turn to ask (its live episodes' contexts, each with its own seed), or None when
        it is over (noted in `_over`, taken in by the next `_receive`)."""
        rnd, seed = play.round, self.cfg.trainer.seed
        if rnd.done():  # at turn 0 too: every reset faulted (no action is asked after one)
            self._over.append(g)
            return None
        play.places = rnd.live()
        seeds = [derive_seed(seed, 0, "rollout/group", g, j, *([rnd.turn] if rnd.turn else [])) for j in play.places]
        return g, [rnd.episodes[j].context() for j in play.places], seeds

    def _receive_turns(self, arrived: list[tuple]) -> list[Sample]:
        """This rank's arrived turns: each group's envs stepped, every group that took a turn made
        durable as it stands (the journal's pending store, through `in_flight_log`) before its next turn
        is asked; the groups over scored. Returns every rank's groups over, as samples (rank order).
        Collective."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t = time.perf_counter()
        took = []
        for g, responses, logps, version in arrived:
            play = self._plays[int(g)]
            play.round.take(play.places, list(responses), list(logps))
            play.versions.append(int(version))
            took.append(int(g))
        _add_time(self._timings, "timing_s/env", time.perf_counter() - t)
        if took:
            failpoint("episodes.before_durable")  # the envs have stepped; the turns are not durable
        states = [self._plays[g].state(g).to_dict() for g in took]
        over, self._over = [g for g in took if self._plays[g].round.done()] + self._over, []
        t = time.perf_counter()
        local = []
        for g in over:
            play = self._plays.pop(g)
            got = self._score_episodes([play.row], n, play.round)
            for j, smp in enumerate(got):
                smp.id, smp.group, smp.policy_version = g + j, g, play.versions[0]
            local += got
        _add_time(self._timings, "timing_s/reward", time.perf_counter() - t)
        gathered = self.rt.all_gather_obj((states, sample_codec.pack(local)))
        kept = [GroupInFlight.from_dict(d) for st, _ in gathered for d in st]
        if kept and self.in_flight_log is not None:
            self.in_flight_log.keep(kept, self._settle)
            self._settle = []
            failpoint("episodes.after_durable")
        asks = [self._next_turn(g, self._plays[g]) for g in took if g in self._plays]
        self.rollout.ask([a for a in asks if a is not None], cfg, max(1, cfg.data.prompts_per_step // self.rt.dp_size))
        return [s for _, cols in gathered for s in sample_codec.unpack(cols)]

    def _receive(self, wait: float) -> None:
        """Take in the groups every rank's generator sent back (rank order, then arrival order): score
        them, add their reference log-probs, and admit them; dynamic sampling drops the groups whose
        rewards do not vary. Collective."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t = time.perf_counter()
        if cfg.rollout.env is not None:
            mine = self.rollout.arrived(wait)
            _add_time(self._timings, "timing_s/gen", time.perf_counter() - t)
            new = self._receive_turns(mine)
            if not new:
                return
        else:
            arrived = [a for got in self.rt.all_gather_obj(self.rollout.arrived(wait)) for a in got]
            _add_time(self._timings, "timing_s/gen", time.perf_counter() - t)  # the wait the update did not cover
            if not arrived:
                return
            t = time.perf_counter()
            new = []
            for g, responses, logps, version in arrived:
                g, row = int(g), self.buffer.requests[int(g)]
                got = self._score([row], n, [self.prompt_ids[row]] * n, list(responses), list(logps))
                for j, smp in enumerate(got):
                    smp.id, smp.group, smp.policy_version = g + j, g, int(version)
                new += got
            _add_time(self._timings, "timing_s/reward", time.perf_counter() - t)
        t = time.perf_counter()
        self._reference_logprobs(new)
        _add_time(self._timings, "timing_s/ref", time.perf_counter() - t)
        out = faults.excluded(new, faults.min_group(cfg.algorithm.name, n))
        dropped = _zero_variance(new, set(out)) if cfg.algorithm.dynamic_sampling else []
        self.buffer.admit(new, dropped + out, {})
        self._flow.added += new
        self._flow.dropped += dropped
        self._flow.faulted += out
        failpoint("async.admit")

    def _flow_inputs(self) -> StepInputs:
        flow, cfg = self._flow, self.cfg
        self._timings.update({"sampling/rounds": float(flow.rounds), "sampling/dropped_groups": float(len(flow.dropped) // cfg.rollout.n),
                              "rollout/regenerated_groups": float(len(flow.regenerated)), **faults.metrics(flow.added)})
        if cfg.rollout.env is not None:
            self._timings.update(_episode_metrics(flow.added), **{"rollout/env/restored_turns": float(flow.restored_turns)})
        ids = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
        return StepInputs(
            seeds=self._seeds,
            data=ev.Data(self.sampler.epoch, self.sampler.cursor, ids([r for _, r in flow.asked]), flow.rounds),
            added=sample_codec.pack(flow.added),
            dropped=ids(flow.dropped),
            consumed=self._consumed,
            timings=self._timings,
            rollout=ev.Rollout(self.rollout.name, self.rollout.version, ev.RolloutMode.ASYNC, cfg.rollout.staleness, ev.AsyncOrder.COMPLETION),
            stale=ids(flow.stale),
            faulted=ids(flow.faulted),
            requests=ev.Requests(ids([g for g, _ in flow.asked]), ids([r for _, r in flow.asked]), ids(flow.regenerated)),
            admitted=True,
        )

    # ================================================================== buffer: shared by live and replay

    def take(self, step: int, inputs: StepInputs) -> list[Sample]:
        """Apply the step's buffer changes (add, drop, plan: unless a live collect did; then consume)
        and return the consumed samples."""
        if not inputs.admitted:  # replay: the journaled batches enter the buffer as they did live
            if inputs.requests is not None:
                self.buffer.request(inputs.requests.groups, inputs.requests.rows, self.cfg.rollout.n)
            self.buffer.admit(sample_codec.unpack(inputs.added), np.concatenate([inputs.dropped, inputs.stale, inputs.faulted]), inputs.plans)
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

    # ================================================================== apply: deterministic

    def apply(self, step: int, inputs: StepInputs, samples: list[Sample]) -> StepOutcome:
        """The deterministic half of a step: from the consumed samples (`take`), the old and reference
        log-probs, advantages (and values and returns for PPO), the DeepSpeed updates of the actor (and
        critic), the metrics and the fingerprint of the state after. The same code serves live
        training and replay, which feeds it journaled inputs: the same inputs give the same bits.
        Collective."""
        seed_globals(inputs.seeds[ev.Stream.TRAIN])  # nothing should draw from them, but if it does it is seeded
        book = StepBook(self.keep_stages)
        scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
        book.metrics.update(_sample_metrics(samples, scores))
        self._record_inputs(book, inputs, samples, scores)
        if samples:
            self._update(step, inputs, samples, scores, book)
        else:  # dynamic sampling found no group with varying rewards: no update this step
            book.metrics.update({"actor/skipped_update": 1.0})
        return self._outcome(book)

    def _update(self, step: int, inputs: StepInputs, samples: list[Sample], scores: torch.Tensor, book: StepBook) -> None:
        """The step's update, top to bottom: this rank's share of the samples, the log-probs of the
        policy the step starts from (and the reference's), the advantages, the critic's update (PPO),
        the actor's; then the metrics averaged over the ranks. Collective."""
        cfg, rt = self.cfg, self.rt
        global_tokens = cfg.algorithm.loss_normalization == "global_tokens"
        rows, minis = shard_batch(samples, cfg.model.actor.mini_batch_size, rt.dp_size, rt.dp_rank, global_tokens)
        mine = [samples[i] for i in rows]
        all_sum = rt.dp_sum if global_tokens and rt.dp_size > 1 else None  # token means over every rank's tokens
        batch = collate(mine, self.tokenizer.pad_token_id, rt.device)
        mask = batch.resp_mask
        # GRPO with one pass over one mini-batch: the policy before the update is the one the
        # update's own forward sees, so the "old" log-probs come from that forward (detached)
        fuse_old = cfg.algorithm.name == "grpo" and cfg.model.actor.ppo_epochs == 1 and len(minis) == 1
        with book.timed("timing_s/old_log_prob"):
            old_lp = None if fuse_old else self.actor.logprobs(batch)
        ref_lp = self._ref_logprobs(mine, mask.shape[1]) if self.needs_reference() else None
        with book.timed("timing_s/adv"):
            advantages, values, returns = self._advantages(samples, rows, batch, scores, old_lp, ref_lp, all_sum, book)
        gen_lp = _padded(mine, "gen_logprobs", mask.shape[1], rt.device)
        if self.critic is not None:
            with book.timed("timing_s/update_critic"):
                book.metrics.update(self.critic.update(batch, values, returns, minis, cfg.model.actor.ppo_epochs))
        async_mode = cfg.rollout.mode == "async"
        # async rollout, and a what-if whose policy is no longer the one that generated: the off-policy correction
        correct = async_mode or inputs.rollout.whatif_correction
        with book.timed("timing_s/update_actor"):
            actor_metrics, before = self.actor.update(batch, advantages, old_lp, ref_lp, minis, gen_lp if correct else None,
                                                      cfg.algorithm.rollout_is_threshold)
            self._record_update(book, mask, before, ref_lp, values, returns, advantages)
            if async_mode:
                book.metrics.update(self._off_policy_metrics(step, samples, before, gen_lp, mask, all_sum))
            if inputs.rollout.whatif:
                book.metrics.update(self._drift_metrics(before, gen_lp, mask, all_sum, correct))
            book.metrics.update(actor_metrics)
        book.metrics.update(self._logprob_gap(step, inputs, mine, gen_lp, before, mask, all_sum))
        book.metrics = rt.mean(book.metrics)
        act = failpoint("update.params")
        if act is not None and act.startswith("flip="):  # fault injection: silent corruption of the weights
            self.actor.flip_a_weight_bit(act)
        self.weights_changed()

    def _ref_logprobs(self, mine: list[Sample], width: int) -> torch.Tensor:
        """The frozen reference's log-probs of this rank's rows ([B, R]), as journaled with the samples."""
        # samples from before a config change that turned the KL on have none journaled
        self._reference_logprobs([s for s in mine if len(s.ref_logprobs) != len(s.response_ids)])
        return _padded(mine, "ref_logprobs", width, self.rt.device)

    def _advantages(self, samples: list[Sample], rows: list[int], batch, scores: torch.Tensor, old_lp, ref_lp, all_sum,
                    book: StepBook) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This rank's advantages ([B, R]), by the algorithm's rule (rl.algorithms); PPO's also the
        critic's values before the update and the returns (GRPO: None, None)."""
        cfg, mask = self.cfg, batch.resp_mask
        values = returns = None
        if cfg.algorithm.name == "grpo":
            groups = torch.tensor([s.group for s in samples], dtype=torch.long)
            advantages = algorithms.grpo_token_advantages(scores, groups, rows, mask, cfg.algorithm.norm_adv_by_std)
        else:
            with book.timed("timing_s/values"):
                values = self.critic.values(batch)
            advantages, returns = algorithms.ppo_advantages(scores[rows].to(self.rt.device), values, mask, old_lp, ref_lp,
                                                            cfg.algorithm.kl_coef, cfg.algorithm.gamma, cfg.algorithm.lam, all_sum)
            book.metrics.update({"critic/values/mean": algorithms.global_masked_mean(values, mask, all_sum).item(),
                                 "critic/returns/mean": algorithms.global_masked_mean(returns, mask, all_sum).item()})
        book.metrics.update({"critic/advantages/mean": algorithms.global_masked_mean(advantages, mask, all_sum).item()})
        return advantages, values, returns

    def _logprob_gap(self, step: int, inputs: StepInputs, mine: list[Sample], gen_lp, before, mask, all_sum) -> dict[str, float]:
        """The engine against the trainer, on the samples generated by the policy the step starts from
        (sync: this step's; carried-over groups and async's stale samples came from an older policy):
        0 when there are none (algorithms.logprob_gap)."""
        rt = self.rt
        if self.cfg.rollout.mode == "async":
            now_rows = [float(s.policy_version == step - 1) for s in mine]
        else:
            fresh = set(Columns(inputs.added).ids.tolist())
            now_rows = [float(s.id in fresh) for s in mine]
        now = torch.tensor(now_rows, device=rt.device)[:, None] * mask
        return algorithms.logprob_gap(gen_lp, before, now, all_sum, rt.max_over if rt.dp_size > 1 else None)

    # ------------------------------------------------------------------ apply's bookkeeping: stages, fingerprint

    def _record_inputs(self, book: StepBook, inputs: StepInputs, samples: list[Sample], scores: torch.Tensor) -> None:
        """The stages the update starts from: the ids it trains on, their dataset rows and tokens, the scores."""
        with book.staging() as rec:
            for worker in (self.critic, self.actor):
                if worker is not None:
                    worker.kept_grads = [] if self.keep_stages else None
            # what the update trains on: the ids consumed and their dataset rows (async: drawn steps before)
            rec.host("data", np.asarray(inputs.consumed, np.int64), np.asarray([s.index for s in samples], np.int64))
            rec.host("samples", *_id_arrays(samples))
            rec.tensor("scores", scores)

    def _record_update(self, book: StepBook, mask, before, ref_lp, values, returns, advantages) -> None:
        """The update's stages: what it started from (log-probs, values, returns, advantages), and each
        worker's losses, gradient norms and gradients (digested inside the update)."""
        with book.staging() as rec:
            rec.tensor("old_logprobs", before * mask, mask)
            if ref_lp is not None:
                rec.tensor("ref_logprobs", ref_lp * mask, mask)
            if self.critic is not None:
                rec.tensor("values", values * mask, mask)
                rec.tensor("returns", returns * mask, mask)
            rec.tensor("advantages", advantages, mask)
            for worker in (self.critic, self.actor):
                if worker is not None:
                    losses, norms, grads, grad_s = worker.stage_outputs()
                    book.stage_s += grad_s  # digested inside the update (its time counts there too)
                    rec.tensor("loss", torch.cat(losses))
                    rec.numbers("grad_norm", norms)
                    for g in grads:
                        if g is not None:
                            rec.digest_only("grads", g)
                    for k, step_grads in enumerate(worker.kept_grads or []):
                        for j, g in enumerate(step_grads):
                            rec.keep("grads", f"{worker.role} optimizer step {k}, gradient {j}", g)

    def _outcome(self, book: StepBook) -> StepOutcome:
        """The step's outcome: its metrics and timings, the fingerprint of the state after it, and the
        stage digests of every rank combined (with the state's parts). Collective."""
        with book.timed("timing_s/fingerprint"):
            fp, parts = self.fingerprint()
        if self.keep_stages:
            for role, engine in self.engines().items():
                for path, leaf in state_leaves(engine):
                    if isinstance(leaf, torch.Tensor):
                        book.rec.keep("state", f"{role}/{path}", leaf)
        with book.staging() as rec:
            stages = combine(self.rt.all_gather_obj(rec.local()), parts)
        book.timings.update({"timing_s/stages": book.stage_s})
        return StepOutcome({**book.metrics, **book.timings}, fp, parts, stages, book.rec.kept)

    def _off_policy_metrics(self, step: int, samples: list[Sample], old_lp, gen_lp, mask, all_sum) -> dict[str, float]:
        """Async rollout: the truncated importance weights min(pi_old / pi_gen, threshold) the update
        used, where pi_old is the policy this step starts from (the clipped ratio's denominator) and
        pi_gen the generator's (journaled with the sample); and the staleness of the step's samples."""
        rt, threshold = self.rt, self.cfg.algorithm.rollout_is_threshold
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

    def _drift_metrics(self, old_lp, gen_lp, mask, all_sum, corrected: bool) -> dict[str, float]:
        """A what-if's step: how far the policy it starts from (pi_whatif) has moved from the one that
        generated its samples (pi_gen, journaled with them), over the response tokens: |log pi_whatif -
        log pi_gen|, mean and max; the importance weights min(pi_whatif / pi_gen, threshold), their
        mean and max, and the share of tokens past the threshold; whether the update applied them."""
        rt, threshold = self.rt, self.cfg.algorithm.rollout_is_threshold
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

    # ================================================================== eval: held-out prompts

    def eval_due(self, step: int) -> bool:
        return bool(self.cfg.trainer.eval_interval) and step % self.cfg.trainer.eval_interval == 0

    def evaluate(self, step: int) -> tuple[dict[str, float], dict]:
        """The policy after step `step`'s update on the held-out prompts: one response each, at
        rollout.eval_temperature (0: greedy; else each from its own seed), scored by the task's own
        scorer (reasoning-gym; rollout.answer_format) or else the rule reward. With rollout.env, each
        held-out prompt is an episode instead (:meth:`_eval_episodes`), scored as training scores one.
        Returns (metrics: eval/score/mean, per task eval/score/TASK/mean for reasoning-gym, and
        eval/response_length/mean, eval/faults (rows an env or the reward function failed: scored 0.0);
        with rollout.env also eval/env/turns/mean and eval/env/faults; the
        `eval` event with every row's response and score, and with rollout.env each row's turns).
        Live steps only: replay reads them back. Draws from no stream training uses. Collective."""
        cfg, rt, held, tok = self.cfg, self.rt, self.data.held_out, self.tokenizer
        mine = np.array_split(np.arange(len(held)), rt.dp_size)[rt.dp_rank]
        rows = mine if len(mine) else np.zeros(1, np.int64)  # a rank with no row still steps with the others (ZeRO-3, TP)
        params = {**sampling_params(cfg), "temperature": cfg.rollout.eval_temperature}
        seeds = [derive_seed(cfg.trainer.seed, step, "eval", int(i)) for i in rows]
        if cfg.rollout.env is not None:
            responses, scores, turns, faulted = self._eval_episodes(step, rows, seeds, params)
            responses, scores, turns, faulted = responses[: len(mine)], scores[: len(mine)], turns[: len(mine)], faulted[: len(mine)]
        else:
            responses, _ = sample_seeded(self.actor.module, [self.held_out_ids[i] for i in rows], seeds, params, tok.eos_token_id,
                                         tok.pad_token_id, rt.device, all_done=rt.all_true)
            responses = responses[: len(mine)]
            prompts = [held[i].prompt for i in mine]
            scores, faulted = scored_or_faults(self.eval_scorer or self.reward_fn, prompts,
                                               [tok.decode(r, skip_special_tokens=True) for r in responses], [held[i] for i in mine])
            turns = None
        gathered = rt.all_gather_obj((mine.tolist(), scores, [r.tolist() for r in responses], turns, faulted))
        out_rows, out_scores, out_resp, out_faults = [], [], [], []
        out_turns: list[tuple[list[int], int]] = []
        for r, (g_rows, g_scores, g_resp, g_turns, g_faults) in enumerate(gathered):
            if r % rt.tp_size == 0:  # TP peers evaluated the same rows
                out_rows += g_rows
                out_scores += g_scores
                out_resp += g_resp
                out_turns += g_turns or []
                out_faults += g_faults
        score = np.asarray(out_scores, np.float64)
        # a row its env or its reward function failed scores 0.0 here, counted (rl.faults): the eval trains nothing
        metrics = {"eval/score/mean": float(score.mean()), "eval/faults": float(sum(map(bool, out_faults))),
                   "eval/response_length/mean": float(np.mean([len(x) for x in out_resp]))}
        tasks = [held[i].task for i in out_rows]
        if len(set(tasks)) > 1 or tasks[0]:
            for task in sorted(set(tasks)):
                metrics[f"eval/score/{task}/mean"] = float(score[[t == task for t in tasks]].mean())
        episode = {}
        if turns is not None:
            ends = np.asarray([end for _, end in out_turns], np.int64)
            metrics.update({"eval/env/turns/mean": float(np.mean([len(lens) // 2 for lens, _ in out_turns])),
                            "eval/env/faults": float(np.sum(ends == EnvEnd.FAULT))})
            episode = {"turn_lens": np.asarray([n for lens, _ in out_turns for n in lens], np.int64),
                       "turns": np.asarray([len(lens) // 2 for lens, _ in out_turns], np.int64), "env_end": ends}
        event = ev.Eval(rows=np.asarray(out_rows, np.int64), scores=score, response_ids=np.asarray([t for x in out_resp for t in x], np.int32),
                        response_len=np.asarray([len(x) for x in out_resp], np.int64), **episode).to_event()
        return metrics, event

    def _eval_episodes(self, step: int, rows, seeds: list[int], params: dict) -> tuple[list[np.ndarray], list[float], list, list[str]]:
        """rollout.env's held-out eval: held-out row `rows[k]` played as an episode (a Round, as training
        plays one), turn 0 generated from `seeds[k]` (the single-turn eval's seed), turn t > 0 from
        ``derive_seed(seed, step, "eval", row, t)``, the env reset with ``derive_seed(seed, step,
        "eval/env", row)``. Scored as training scores an episode: the env's rewards summed, plus the rule
        reward of the last action when rollout.reward_fn is named (reward_fn_named). Returns each
        episode's (response ids: actions and observations, score, (turn_lens, env_end), its fault: "" none). Collective: the
        ranks generate each turn together while any rank has an episode going."""
        cfg, rt, held, tok = self.cfg, self.rt, self.data.held_out, self.tokenizer
        examples = [held[int(i)] for i in rows]
        env_seeds = [derive_seed(cfg.trainer.seed, step, "eval/env", int(i)) for i in rows]
        eps = Round(self._envs(), [row_of(ex) for ex in examples], env_seeds, [self.held_out_ids[int(i)] for i in rows], tok,
                    Limits.of(cfg.rollout))
        places = eps.live()  # a reset that faulted: no action
        contexts, seeds = [eps.first_prompts()[i] for i in places] or eps.first_prompts()[:1], [seeds[i] for i in places] or [0]
        while True:
            responses, logps = sample_seeded(self.actor.module, contexts, seeds, params, tok.eos_token_id, tok.pad_token_id, rt.device,
                                             all_done=rt.all_true)
            if places:
                eps.take(places, responses, logps)
            if rt.all_true(eps.done()):
                break
            places = [] if eps.done() else eps.live()
            contexts = [eps.episodes[i].context() for i in places]
            seeds = [derive_seed(cfg.trainer.seed, step, "eval", int(rows[i]), eps.turn) for i in places]
            if not places:  # this rank's episodes are over, another rank's are not: step with it, keep nothing
                contexts, seeds = [eps.episodes[0].context()], [0]
        scores = [eps.env_score(k) for k in range(len(rows))]
        faulted = [ep.reason if ep.end == EnvEnd.FAULT else "" for ep in eps.episodes]
        if self.reward_fn_named():
            rule, bad = scored_or_faults(self.reward_fn, [ex.prompt for ex in examples], [ep.last_action for ep in eps.episodes], examples)
            scores = [s + r for s, r in zip(scores, rule)]
            faulted = [f or b for f, b in zip(faulted, bad)]
        ends = [int(EnvEnd.MAX_TURNS) if ep.live else ep.end for ep in eps.episodes]  # as Round.fields says it
        return ([np.asarray(ep.response, np.int64) for ep in eps.episodes], scores,
                [(list(ep.turn_lens), end) for ep, end in zip(eps.episodes, ends)], faulted)

    def buffer_metrics(self) -> dict[str, float]:
        """The buffer once the step is done (async: with the batch generated during the update):
        live steps read it after finish_collect, replay after apply."""
        out = {"buffer/pending": float(len(self.buffer))}
        if self.cfg.rollout.free_running:
            out.update({"buffer/requested_groups": float(len(self.buffer.requests))})
        return out

    # ================================================================== Stateful parts

    def state_parts(self) -> dict:
        """The trainer's rank-agnostic Stateful parts, by name (snapshots loop over these; the
        DeepSpeed engines are the sharded parts: see engines())."""
        return {"sampler": self.sampler, "buffer": self.buffer, "train_state": self.train_state}

    def advance_sampler(self, inputs: StepInputs) -> None:
        """Replay: the sampler ends where the journal says this step left it."""
        self.sampler.move_to(inputs.data.epoch, inputs.data.cursor)


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


def _zero_variance(samples: list[Sample], excluded: set[int]) -> list[int]:
    """Dynamic sampling: the ids of the groups whose rewards do not vary, over their samples not `excluded` (faults)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        if s.id not in excluded:
            groups.setdefault(s.group, []).append(s)
    return [s.id for g in groups.values() if max(x.score for x in g) == min(x.score for x in g) for s in g]


def _episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """rollout.env: the episodes generated this step: how many an env fault ended, their turns."""
    turns = [len(s.turn_lens) // 2 for s in samples if s.is_episode]
    return {"rollout/env/faults": float(sum(s.env_end == EnvEnd.FAULT for s in samples)),
            "rollout/env/turns/mean": float(np.mean(turns)) if turns else 0.0}


def _add_time(timings: dict[str, float], name: str, seconds: float) -> None:
    timings.update({name: timings.get(name, 0.0) + seconds})


def _id_arrays(samples: list[Sample]) -> tuple[np.ndarray, ...]:
    """The consumed samples' ids, prompt and response token ids and their lengths, as flat arrays."""
    ids = np.asarray([s.id for s in samples], np.int64)
    lens = np.asarray([[len(s.prompt_ids), len(s.response_ids)] for s in samples], np.int64).reshape(-1, 2)
    flat = [np.asarray(x, np.int64) for s in samples for x in (s.prompt_ids, s.response_ids)]
    return ids, lens, np.concatenate(flat) if flat else np.zeros(0, np.int64)


def _padded(samples: list[Sample], key: str, width: int, device) -> torch.Tensor:
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

