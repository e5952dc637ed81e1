"""DeepSpeed workers: the actor (with its frozen reference, held only while the config reads it) and the PPO critic.

Each wraps one ``deepspeed.initialize`` engine (ZeRO stage 0-3, AutoTP when
``distributed.tensor_parallel_size > 1``). The update loops over mini-batches and micro-batches;
the number of micro-batches can change from step to step (dynamic sampling), so the engine's
gradient-accumulation count is set per mini-batch with ``set_train_batch_size``.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verlj.journal.failpoints import failpoint

from ..config import Config, OptimConfig
from ..dist import Runtime
from ..schema.sample import Sample
from ..state.bitflip import flip_one_bit
from ..state.fingerprint import group_sums
from . import algorithms, lora


def ds_config(optim: OptimConfig, cfg: Config, rt: Runtime, micro: int, n_params: int) -> dict:
    # DeepSpeed's default buckets are 5e8 elements: gigabytes zero-filled per engine, whatever the
    # model's size. Size them to the model (at most the default) so small runs stay small.
    bucket = int(min(5e8, max(1e6, n_params)))
    conf = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                "torch_adam": True,
                **({"fused": True} if optim.fused else {}),
            },
        },
        "gradient_clipping": 0.0 if verlj_clips(cfg, rt, cfg.distributed.zero_stage) else optim.grad_clip,
        "zero_optimization": {
            "stage": cfg.distributed.zero_stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket,
        },
        "bf16": {"enabled": cfg.trainer.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if optim.warmup_steps > 0:
        conf.update(scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": optim.lr, "warmup_num_steps": optim.warmup_steps, "warmup_type": "linear"},
        })
    if rt.tp_size > 1:
        conf.update(tensor_parallel={"autotp_size": rt.tp_size})
    return conf


def verlj_clips(cfg: Config, rt: Runtime, zero_stage: int) -> bool:
    """AutoTP at ZeRO-0: DeepSpeed (0.19) has no model-parallel unit there and clips each rank's
    gradients by the norm of that rank's shards alone, so TP ranks clip by different factors and the
    objective depends on the TP size. verlj computes the whole model's norm and clips itself
    (:func:`clip_tp_gradients`). Runs from before (loss_normalization=micro_batch) keep DeepSpeed's."""
    return rt.tp_size > 1 and zero_stage == 0 and cfg.algorithm.loss_normalization == "global_tokens"


def clip_tp_gradients(engine, full_shapes: dict[str, tuple], max_norm: float, rt: Runtime) -> float:
    """Clip by the norm of the whole model's gradient (sharded parameters summed over the TP group,
    replicated ones counted once), as DeepSpeed clips an unsharded model. Returns that norm."""
    import torch.distributed as dist

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = []
    for name, p in engine.module.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if tuple(p.shape) == tuple(full_shapes[name]):
            replicated += sq
        else:
            sharded += sq
        grads.append(p.grad)
    if rt.world_size > 1:
        sharded = sharded.to(rt.device)
        dist.all_reduce(sharded)  # over every rank: each TP group's sum, once per data-parallel replica
        sharded = sharded.cpu() / rt.dp_size
    norm = float(torch.sqrt(sharded + replicated))
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def trainable_shapes(module: torch.nn.Module) -> dict[str, tuple]:
    """{name: whole shape} of the parameters an engine trains, in module order, before DeepSpeed
    partitions (ZeRO-3) or shards (AutoTP) them: how state.reshard lays out and checks a snapshot."""
    return {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}


def make_engine(module: torch.nn.Module, optim: OptimConfig, cfg: Config, rt: Runtime, micro: int):
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    with _masters_made_one_by_one(cfg.trainer.precision == "bf16" and cfg.distributed.zero_stage == 0):
        engine, _, _, _ = deepspeed.initialize(
            model=module, model_parameters=params, config=ds_config(optim, cfg, rt, micro, sum(p.numel() for p in params))
        )
    if (rt.world_size == 1 and engine.zero_optimization_stage() == 0 and not hasattr(engine.optimizer, "get_grads_for_reduction")
            and all(p.dtype == engine.communication_data_type for p in engine.module.parameters() if p.requires_grad)):
        engine.enable_backward_allreduce = False  # reduce_alone does what it would, without the copy
    return engine


@contextmanager
def _masters_made_one_by_one(on: bool) -> Iterator[None]:
    """While DeepSpeed builds an engine: its bf16 wrapper at ZeRO-0 (FP16_UnfusedOptimizer) makes its
    optimizer's state by a step on zero gradients (weight decay and the step count included), with every
    master's fp32 gradient made at once (4 bytes a parameter, and 2 more of bf16 ones it never reads);
    this makes the same step a master at a time, and binds the wrapper's step to
    :func:`step_masters_one_by_one` (the same bits: a test builds DeepSpeed's own engine beside it)."""
    if not on:
        yield
        return
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    theirs = FP16_UnfusedOptimizer.initialize_optimizer_states
    FP16_UnfusedOptimizer.initialize_optimizer_states = _init_masters_one_by_one  # type: ignore[method-assign]
    try:
        yield
    finally:
        FP16_UnfusedOptimizer.initialize_optimizer_states = theirs  # type: ignore[method-assign]


def _init_masters_one_by_one(self) -> None:
    _each_master_alone(self, lambda master, low: torch.zeros(master.size(), dtype=master.dtype, device=master.device))
    if not self.fused_lamb_legacy:  # (FusedLamb's legacy step is left to DeepSpeed)
        self.step = types.MethodType(step_masters_one_by_one, self)


def _each_master_alone(self, grad: Callable, after: Callable | None = None) -> None:
    """Step each fp32 master of DeepSpeed's bf16 wrapper `self` alone: its gradient made by
    grad(master, bf16 parameter), the inner optimizer stepped on that master only (its group's settings),
    the gradient dropped, then after(master, bf16 parameter)."""
    inner, groups = self.optimizer, self.optimizer.param_groups
    try:
        for i, group in enumerate(groups):
            for master, low in zip(self.fp32_groups[i], self.fp16_groups[i]):
                master.grad = grad(master, low)
                inner.param_groups = [{**group, "params": [master]}]
                inner.step()
                master.grad = None
                if after is not None:
                    after(master, low)
    finally:
        inner.param_groups = groups


def step_masters_one_by_one(self) -> bool:
    """FP16_UnfusedOptimizer.step (DeepSpeed 0.19) with the same bits, a master at a time: its step makes the
    fp32 gradient of every master, then steps them all, holding 4 bytes a parameter of gradients at the
    update's peak beside the bf16 ones (2 GiB at 500M parameters); this one makes a master's fp32 gradient,
    scales it as DeepSpeed would (the clip factor of the norm over all the bf16 gradients, computed first
    as there), steps that master alone and drops the gradient before the next. AdamW's update is
    elementwise within a parameter, so stepping the masters apart is the same arithmetic (a test compares
    three steps each way). `self` is the wrapper (bound as it is made: _masters_made_one_by_one)."""
    from deepspeed.runtime.fp16 import unfused_optimizer as uo

    self.overflow = self.overflow_checker.check()
    if self.overflow:
        return self._skip_invalid_grad_norm()
    norm_groups = []
    for group in self.fp16_groups:
        grads_for_norm, _ = uo.split_params_grads_into_shared_and_expert_params(group)
        norm_groups.append(uo.get_weight_norm(grads_for_norm, mpu=self.mpu) if grads_for_norm else 0.0)
    self._global_grad_norm = uo.get_global_norm(norm_list=norm_groups)
    if uo.is_invalid_grad_norm(self._global_grad_norm):
        return self._skip_invalid_grad_norm()
    self._update_scale(False)
    scale = self.unscale_and_clip_grads(self._global_grad_norm, apply_scale=False)

    def grad(master, low):
        g = torch.zeros(low.size(), dtype=master.dtype, device=master.device) if low.grad is None else low.grad.to(master.dtype)
        return g.mul_(1.0 / scale)

    _each_master_alone(self, grad, after=lambda master, low: low.data.copy_(master.data))
    return self.overflow


def reduce_alone(engine) -> None:
    """What DeepSpeed's fallback all-reduce does to the gradients at ZeRO-0 on one rank, in the gradients'
    own dtype (make_engine picks the case), without its flat copy of every gradient (a buffer of 4 bytes a
    parameter in fp32, 2 in bf16, at the step's peak): a trained parameter without a gradient gets zeros,
    so the optimizer steps it as DeepSpeed's would (decay, moments); the values are left alone, as a sum
    and a mean over one rank leave them. Call at the accumulation boundary, after backward, where
    DeepSpeed reduces."""
    for p in engine.module.parameters():
        if p.requires_grad and p.numel() > 0 and p.grad is None:
            p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Samples collated for a forward pass: prompt+response right-padded, response positions indexed."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    resp_index: torch.Tensor  # [B, R]: position in the shifted (next-token) frame of response token t
    resp_mask: torch.Tensor  # [B, R] float
    response_ids: torch.Tensor  # [B, R]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, a: int, b: int) -> Batch:
        return Batch(*(t[a:b] for t in (self.input_ids, self.attention_mask, self.resp_index, self.resp_mask, self.response_ids)))


def collate(samples: list[Sample], pad_id: int, device) -> Batch:
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    R = max(len(s.response_ids) for s in samples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    index = torch.zeros((B, R), dtype=torch.long)
    rmask = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, :p] = torch.as_tensor(s.prompt_ids)
        ids[i, p : p + r] = torch.as_tensor(s.response_ids)
        att[i, : p + r] = 1
        resp[i, :r] = torch.as_tensor(s.response_ids)
        index[i] = torch.clamp(torch.arange(R) + p - 1, max=L - 2)
        if s.is_episode:  # observation tokens are out of the loss, the KL, the entropy and the advantages' means
            rmask[i, :r] = torch.from_numpy(s.policy_mask())
        else:
            rmask[i, :r] = 1.0
    return Batch(ids.to(device), att.to(device), index.to(device), rmask.to(device), resp.to(device))


def response_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False):
    """Log-probs [B, R] of the response tokens (and their entropies) under `model`."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / temperature
    idx = batch.resp_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    resp_logits = torch.gather(logits, 1, idx)  # [B, R, V]
    logp = torch.log_softmax(resp_logits, dim=-1).gather(-1, batch.response_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = algorithms.entropy_from_logits(resp_logits) if with_entropy else None
    return logp * batch.resp_mask, ent


def micro_chunks(n: int, micro: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + micro)) for a in range(0, n, micro)]


@dataclass
class MiniBatch:
    """One optimizer step's samples on this rank: rows start..stop of the rank's batch."""

    start: int
    stop: int
    tokens: float | None  # response tokens of the whole mini-batch on all ranks (global_tokens), else None
    seqs: int | None = None  # its samples on all ranks (global_tokens), else None


def shard_batch(samples: list[Sample], mini_size: int, dp_size: int, dp_rank: int,
                global_tokens: bool) -> tuple[list[int], list[MiniBatch]]:
    """Which of the step's samples this data-parallel rank trains on (indices, in order) and how
    they form mini-batches.

    global_tokens: the step's samples are cut into mini-batches of `mini_size` (0: one) first, and
    each is split evenly over the ranks; every micro-batch divides by its mini-batch's token count
    over all ranks. The mini-batches and the objective are then the same at any world size; only
    the order of the floating-point sums changes.
    Otherwise (``algorithm.loss_normalization=micro_batch``, runs from before): each rank takes a
    contiguous share, cut into mini-batches of mini_size // dp_size, each micro-batch its own token-mean."""
    S, D, r = len(samples), dp_size, dp_rank
    if not global_tokens:
        a, b = r * (S // D), (r + 1) * (S // D)
        per_rank = (b - a) if mini_size == 0 else max(1, mini_size // D)
        return list(range(a, b)), [MiniBatch(x, y, None) for x, y in micro_chunks(b - a, per_rank)]
    rows: list[int] = []
    minis: list[MiniBatch] = []
    for a, b in micro_chunks(S, mini_size or S):
        share = (b - a) // D
        tokens = float(sum(samples[i].policy_tokens() for i in range(a, b)))
        minis.append(MiniBatch(len(rows), len(rows) + share, tokens, share * D))
        rows += range(a + r * share, a + (r + 1) * share)
    return rows, minis


@dataclass
class Micro:
    rows: slice  # of the rank's batch
    boundary: bool  # the last micro-batch of its mini-batch: the optimizer steps after it
    denom: float | None  # divide summed token terms by this (None: the micro-batch's own token count)
    scale: float  # undo DeepSpeed's 1/accumulation and 1/dp averaging of the gradients (1 when denom is None)
    seqs: int | None = None  # divide summed sample terms by this (loss_agg_mode seq-*; None: the micro-batch's rows)


def accumulation(engine, micro: int, dp: int, mini_batches: list[MiniBatch], epochs: int):
    """Yield a :class:`Micro` per micro-batch. A mini-batch is one optimizer step: DeepSpeed's
    accumulation count is set to its number of micro-batches, which may change between steps, and
    its boundary is set for each micro-batch (DeepSpeed's own count runs on from step to step: after
    a step of 3 micro-batches, one of 2 would step the optimizer after its first and carry the
    second's gradient into the next step, which a resume from a snapshot never has)."""
    for _ in range(epochs):
        for m in mini_batches:
            chunks = micro_chunks(m.stop - m.start, micro)
            engine.set_train_batch_size(micro * len(chunks) * dp)
            scale = 1.0 if m.tokens is None else float(len(chunks) * dp)
            for ca, cb in chunks:
                engine.set_gradient_accumulation_boundary(cb == chunks[-1][1])
                yield Micro(slice(m.start + ca, m.start + cb), cb == chunks[-1][1], m.tokens, scale, m.seqs)


class UpdateStats:
    """An update's metrics. Per micro-batch token means (micro_batch normalisation): their mean over
    micro-batches, as before. global_tokens: a micro-batch adds its share of its mini-batch's token
    mean; the mini-batch's value is the sum over micro-batches and ranks (times dp here, then the
    mean over ranks in ``Trainer.apply``); the step's is the mean over mini-batches."""

    def __init__(self, dp: int):
        self.dp = dp
        self.values: dict[str, list[float]] = {}
        self.partial: dict[str, float] = {}

    def token_term(self, mb: Micro, key: str, value: float) -> None:
        if mb.denom is None:
            self.values.setdefault(key, []).append(value)
        else:
            self.partial[key] = self.partial.get(key, 0.0) + value

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)

    def end_micro(self, mb: Micro) -> None:
        if mb.boundary and self.partial:
            for k, v in self.partial.items():
                self.values.setdefault(k, []).append(v * self.dp)
            self.partial = {}

    def result(self) -> dict[str, float]:
        return {k: float(np.mean(v)) for k, v in self.values.items()}


# ----------------------------------------------------------------------------- actor


class _Stepper:
    """engine.step() for a worker, clipping TP gradients itself where DeepSpeed cannot (verlj_clips)."""

    engine: Any  # deepspeed.DeepSpeedEngine (DeepSpeed is read as Any)
    cfg: Config
    rt: Runtime
    full_shapes: dict
    optim: OptimConfig  # the worker's own optimizer section (actor or critic)
    stage_losses: list
    stage_norms: list
    stage_grads: list
    stage_seconds: float

    def _backward_and_step(self, mb: Micro, loss, stats: UpdateStats, prefix: str) -> None:
        """Backward (scaled when the loss is a share of a global token mean), then the engine's step;
        the gradient norm is recorded at the mini-batch boundary. The stage digests (state.stages)
        get every micro-batch's loss, each optimizer step's gradient norm and local gradients."""
        self.engine.backward(loss if mb.denom is None else loss * mb.scale)
        self.stage_losses.append(loss.detach().float().reshape(1))
        if mb.boundary:
            if not self.engine.enable_backward_allreduce:
                reduce_alone(self.engine)
            act = failpoint("update.grads")
            if act is not None and act.startswith("flip="):
                self._flip_a_gradient_bit(act)
            t = time.perf_counter()
            grads = [g for _, g in self._local_grads()]
            self.stage_grads.append(group_sums(grads) if grads else None)
            if self.kept_grads is not None:  # a re-execution for `verlj diff --stages`: the values themselves
                self.kept_grads.append([g.detach().cpu().clone() for g in grads])
            self.stage_seconds += time.perf_counter() - t
        norm = self._step(mb.boundary)
        if mb.boundary:
            stats.add(f"{prefix}/grad_norm", norm)
            self.stage_norms.append(norm)
        stats.end_micro(mb)

    kept_grads: list | None  # a host copy of every optimizer step's gradients since the last call (None: not kept)

    def stage_outputs(self) -> tuple[list, list, list, float, list]:
        """(losses, gradient norms, gradient sums, seconds spent digesting gradients, each optimizer step's gradients
        where they are kept, else []) since the last call, cleared."""
        out = (self.stage_losses, self.stage_norms, self.stage_grads, self.stage_seconds, self.kept_grads or [])
        self.stage_losses, self.stage_norms, self.stage_grads, self.stage_seconds = [], [], [], 0.0
        self.kept_grads = [] if self.kept_grads is not None else None
        return out

    def _local_grads(self) -> list:
        """This rank's gradients before the optimizer step, as [(parameter or None, gradient)], where
        DeepSpeed leaves them: ``.grad`` at ZeRO-0 and with TP, this rank's partition in the
        optimizer's ``averaged_gradients`` at ZeRO-1/2 (None for the parameter: the pieces are
        partition slices), the local partition at ZeRO-3."""
        zero = self.engine.zero_optimization_stage()
        if zero in (1, 2):
            averaged = getattr(self.engine.optimizer, "averaged_gradients", None) or {}
            return [(None, g) for i in sorted(averaged) for g in (averaged[i] or []) if g is not None]
        grads = []
        for p in self.engine.module.parameters():
            g = p.grad
            if g is None and hasattr(p, "ds_id"):
                from deepspeed.utils import safe_get_local_grad

                try:
                    g = safe_get_local_grad(p)
                except (AssertionError, AttributeError, KeyError, RuntimeError):
                    g = None
            if g is not None:
                grads.append((p, g))
        return grads

    def _flip_a_gradient_bit(self, action: str) -> None:
        """Fault injection (the ``update.grads`` failpoint): one bit of this step's gradients flipped."""
        pairs = self._local_grads()
        flip_one_bit([g for _, g in pairs], action)
        if self.engine.zero_optimization_stage() == 3:  # its local gradients can be copies: written back
            from deepspeed.utils import safe_set_local_grad

            for p, g in pairs:
                safe_set_local_grad(p, g)

    def flip_a_weight_bit(self, action: str) -> None:
        """Fault injection (the ``update.params`` failpoint): one bit of the weights flipped, where the
        state lives: the parameters at ZeRO-0, the optimizer's fp32 master partition at ZeRO-1/2
        (which the module's copy is refreshed from, and which a snapshot saves and reloads), and at
        ZeRO-3 the same bit of the master and of the parameters' partition (a ZeRO-3 snapshot saves
        the master only and rebuilds the partition from it: the two must agree to round-trip)."""
        opt, zero = self.engine.optimizer, self.engine.zero_optimization_stage()
        if zero in (1, 2):
            flip_one_bit(list(opt.single_partition_of_fp32_groups), action)
        elif zero == 3:
            flip_one_bit(list(opt.fp32_partitioned_groups_flat), action)
            if any(a is not b for a, b in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat)):
                flip_one_bit(list(opt.fp16_partitioned_groups_flat), action)
        else:
            flip_one_bit([p.data for p in self.engine.module.parameters() if p.requires_grad], action)  # the trained state (LoRA: not the base)

    def _result(self, stats: UpdateStats, prefix: str) -> dict[str, float]:
        out = stats.result()
        out[f"{prefix}/lr"] = float(self.engine.get_lr()[0])
        return out

    def _step(self, boundary: bool) -> float:
        if boundary and verlj_clips(self.cfg, self.rt, self.engine.zero_optimization_stage()):
            norm = clip_tp_gradients(self.engine, self.full_shapes, self.optim.grad_clip, self.rt)
            self.engine.step()
            return norm
        return _step(self.engine, boundary)


def needs_reference(cfg: Config) -> bool:
    """Whether the update reads the frozen reference's log-probs (GRPO's KL loss, PPO's KL reward)."""
    return (cfg.algorithm.name != "ppo" and cfg.model.actor.use_kl_loss) or cfg.algorithm.kl_coef > 0


class ActorWorker(_Stepper):
    role = "actor"

    def __init__(self, model: torch.nn.Module, cfg: Config, rt: Runtime, reference: Callable[[], torch.nn.Module], keep_grads: bool = False):
        """`reference` loads the frozen reference afresh (the actor's initial weights, as the run's
        start loaded them), at the first step that reads its log-probs: never in a run without a KL
        term (:func:`needs_reference`), which so holds no second copy of the model, and never in a
        replay, which reads them from the journal; a live config change that turns the KL term on
        loads it then (the same weights: the reference never trains). `keep_grads`: keep a host copy of every
        optimizer step's gradients (`verlj diff --stages`)."""
        self.cfg, self.rt = cfg, rt
        self.actor_cfg = cfg.model.actor
        self.optim = self.actor_cfg.optim
        self.lora = lora.enabled(cfg)  # the module carries LoRA adapters: the reference is its base, adapters off
        self._load_reference = reference
        self.ref: torch.nn.Module | None = None  # loaded by reference_logprobs
        model.train()
        self.full_shapes = trainable_shapes(model)
        self.engine = make_engine(model, self.actor_cfg.optim, cfg, rt, self.actor_cfg.micro_batch_size)
        self.temperature = cfg.rollout.temperature
        self.stage_losses, self.stage_norms, self.stage_grads, self.stage_seconds = [], [], [], 0.0
        self.kept_grads: list | None = [] if keep_grads else None

    def _reference(self) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):  # loading consumes none of the run's random streams
            ref = self._load_reference().to(self.rt.device).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    @property
    def module(self):
        return self.engine.module

    def set_config(self, cfg: Config) -> None:
        self.cfg, self.actor_cfg, self.temperature = cfg, cfg.model.actor, cfg.rollout.temperature
        self.optim = self.actor_cfg.optim
        _set_lr(self.engine, self.actor_cfg.optim)
        if not needs_reference(cfg):
            self.ref = None  # its memory back; loaded again if a later change reads it

    @torch.no_grad()
    def logprobs(self, batch: Batch, model=None) -> torch.Tensor:
        model = self.engine.module if model is None else model
        was = model.training
        model.eval()
        out = [response_logprobs(model, batch.slice(a, b), self.temperature)[0] for a, b in micro_chunks(len(batch), self.actor_cfg.micro_batch_size)]
        model.train(was)
        return torch.cat(out)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """The frozen reference's log-probs: the actor's initial weights loaded apart (at the first call),
        or with LoRA the base itself (the same module with its adapters switched off)."""
        if not self.lora:
            if self.ref is None:
                self.ref = self._reference()
            return self.logprobs(batch, model=self.ref)
        with self.engine.module.disable_adapter():
            return self.logprobs(batch)

    def policy_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights whole, under the model's own names, on every rank (what a generation
        engine that holds its own copy loads): with LoRA, merged into the base. Collective."""
        if self.lora:
            return lora.merged_weights(self.engine.module)
        from ..state.reshard import full_parameters

        return full_parameters(self.engine, self.rt, self.full_shapes)

    def update(self, batch: Batch, advantages, old_logprobs, ref_logprobs,
               mini_batches: list[MiniBatch], gen_logprobs=None, is_threshold: float = 0.0) -> tuple[dict[str, float], torch.Tensor]:
        """One update over the step's mini-batches. Returns its metrics and the log-probs of the
        policy before it ([B, R]: ``old_logprobs``, or, fused, those of each row's first forward).
        ``gen_logprobs`` ([B, R], async rollout): the generator's; each token's policy loss is weighted
        by its truncated importance weight (algorithms.truncated_is_weights)."""
        stats = UpdateStats(self.rt.dp_size)
        before = old_logprobs if old_logprobs is not None else torch.zeros_like(advantages)
        for mb in accumulation(self.engine, self.actor_cfg.micro_batch_size, self.rt.dp_size, mini_batches, self.actor_cfg.ppo_epochs):
            sl, micro_batch = mb.rows, batch.slice(mb.rows.start, mb.rows.stop)
            mask = micro_batch.resp_mask
            logp, ent = response_logprobs(self.engine, micro_batch, self.temperature, with_entropy=True)
            if old_logprobs is None:  # fused (see rl.update._update): one epoch over one mini-batch, each row seen once
                before[sl] = logp.detach()
            old = logp.detach() if old_logprobs is None else old_logprobs[sl]
            weights = None if gen_logprobs is None else algorithms.truncated_is_weights(old, gen_logprobs[sl], mask, is_threshold)[0]
            agg = self._aggregation(mb)
            pg_loss, clipfrac, ppo_kl = algorithms.policy_loss(logp, old, advantages[sl], mask, self._clip_low(), mb.denom, weights,
                                                               clip_ratio_high=self._clip_high(), loss_mode=self.actor_cfg.loss_mode,
                                                               agg=agg.mode, seqs=agg.seqs, norm_len=agg.norm_len)
            entropy = agg(ent, mask, mb.denom)
            loss = pg_loss - self.actor_cfg.entropy_coeff * entropy
            if self.cfg.algorithm.name != "ppo" and self.actor_cfg.use_kl_loss:
                kl = agg(algorithms.kl_k3(logp, ref_logprobs[sl]), mask, mb.denom)
                loss = loss + self.actor_cfg.kl_loss_coef * kl
                stats.token_term(mb, "actor/kl_loss", kl.item())
            stats.token_term(mb, "actor/pg_loss", pg_loss.item())
            stats.token_term(mb, "actor/pg_clipfrac", clipfrac.item())
            stats.token_term(mb, "actor/ppo_kl", ppo_kl.item())
            stats.token_term(mb, "actor/entropy", entropy.item())
            self._backward_and_step(mb, loss, stats, "actor")
        return self._result(stats, "actor"), before

    def _aggregation(self, mb: Micro) -> algorithms.Aggregation:
        """algorithms.policy_loss's aggregation for micro-batch `mb` (algorithm.loss_agg_mode)."""
        return algorithms.Aggregation(self.cfg.algorithm.loss_agg_mode, mb.seqs if mb.denom is not None else None,
                                      float(self.cfg.rollout.max_response_length))

    def _clip_low(self) -> float:
        low = self.actor_cfg.clip_ratio_low
        return self.actor_cfg.clip_ratio if low is None else low

    def _clip_high(self) -> float:
        high = self.actor_cfg.clip_ratio_high
        return self.actor_cfg.clip_ratio if high is None else high


# ----------------------------------------------------------------------------- critic


class CriticWorker(_Stepper):
    role = "critic"

    def __init__(self, module: torch.nn.Module, cfg: Config, rt: Runtime, keep_grads: bool = False):
        self.cfg, self.rt = cfg, rt
        self.critic_cfg = cfg.model.critic
        self.optim = self.critic_cfg.optim
        module.train()
        self.full_shapes = trainable_shapes(module)
        self.engine = make_engine(module, self.critic_cfg.optim, cfg, rt, self.critic_cfg.micro_batch_size)
        self.stage_losses, self.stage_norms, self.stage_grads, self.stage_seconds = [], [], [], 0.0
        self.kept_grads: list | None = [] if keep_grads else None

    def set_config(self, cfg: Config) -> None:
        self.cfg, self.critic_cfg = cfg, cfg.model.critic
        self.optim = self.critic_cfg.optim
        _set_lr(self.engine, self.critic_cfg.optim)

    def _values(self, model, batch: Batch) -> torch.Tensor:
        v = model(batch.input_ids, batch.attention_mask)[:, :-1].float()  # value of the state before each next token
        return torch.gather(v, 1, batch.resp_index) * batch.resp_mask

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        self.engine.module.eval()
        out = [self._values(self.engine.module, batch.slice(a, b)) for a, b in micro_chunks(len(batch), self.critic_cfg.micro_batch_size)]
        self.engine.module.train()
        return torch.cat(out)

    def update(self, batch: Batch, old_values, returns, mini_batches: list[MiniBatch], epochs: int) -> dict[str, float]:
        stats = UpdateStats(self.rt.dp_size)
        for mb in accumulation(self.engine, self.critic_cfg.micro_batch_size, self.rt.dp_size, mini_batches, epochs):
            sl, micro_batch = mb.rows, batch.slice(mb.rows.start, mb.rows.stop)
            v = self._values(self.engine, micro_batch)
            loss, clipfrac = algorithms.value_loss(v, old_values[sl], returns[sl], micro_batch.resp_mask, self.critic_cfg.cliprange_value, mb.denom)
            stats.token_term(mb, "critic/vf_loss", loss.item())
            stats.token_term(mb, "critic/vf_clipfrac", clipfrac.item())
            self._backward_and_step(mb, loss, stats, "critic")
        return self._result(stats, "critic")


def _set_lr(engine, optim: OptimConfig) -> None:
    """Apply a changed learning rate (without a scheduler; with one, the schedule owns the LR)."""
    if engine.lr_scheduler is None:
        for group in engine.optimizer.param_groups:
            group["lr"] = optim.lr


def _step(engine, boundary: bool) -> float:
    """engine.step(); at the accumulation boundary, the global grad norm before clipping.
    DeepSpeed records it for ZeRO and mixed precision; for plain fp32 without ZeRO we measure it."""
    measured = None
    if boundary and not engine.zero_optimization() and not engine.bfloat16_enabled() and not engine.fp16_enabled():
        from deepspeed.runtime.utils import get_flattened_grad_norm

        measured = float(get_flattened_grad_norm(list(engine.module.parameters()), mpu=engine.mpu))
    engine.step()
    g = engine.get_global_grad_norm() if measured is None else measured
    return float(g) if g is not None else float("nan")
