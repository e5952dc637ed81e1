"""bf16 as users train on GPUs (trainer.precision=bf16: DeepSpeed's bf16 configuration, bf16 compute with fp32
master weights in the optimizer) on CPU: SIGKILLed right after a commit and resumed, the run is bit-identical to
an uninterrupted one, at ZeRO 0 (DeepSpeed's BF16_Optimizer) and ZeRO 3 (masters partitioned)."""

from __future__ import annotations

import pytest
import torch

from verlj.engine.loop.run import train as run_train
from verlj.engine.state.safe_load import load_weights_only
from verlj_testing import LEAVE, TINY, env, fingerprints, kill_and_resume

BF16 = ["trainer.precision=bf16", "trainer.total_steps=5", "trainer.save_interval=2"]


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_killed_and_resumed_is_bit_identical(tmp_path, stage):
    over = [*BF16, f"distributed.zero_stage={stage}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, None, [*TINY, *over])
    out = kill_and_resume(run, ref, *over, failpoint="journal.after_commit:3")
    assert "Replayed step 3 from the journal" in out.stdout + out.stderr and len(fingerprints(ref)) == 5
    if stage == 0:  # the snapshot keeps the fp32 masters beside the bf16 weights
        states = load_weights_only(run / "step_00004" / "actor" / "mp_rank_00_model_states.pt")
        assert {t.dtype for t in states["module"].values()} == {torch.bfloat16}
        masters = states["optimizer"]["fp32_groups"]
        assert masters and all(t.dtype == torch.float32 for group in masters for t in group)


_REDUCE_ALONE = r"""
import sys, torch
from verlj.engine.config import make_config
from verlj.engine.dist import setup
from verlj.engine.rl import workers
from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm

cfg = make_config(None, ["trainer.precision=" + sys.argv[1], "model.actor.optim.weight_decay=0.1"])
rt = setup(cfg)
torch.use_deterministic_algorithms(True)

def engine(theirs):
    module = load_causal_lm(BUILTIN_TINY, cfg, 0)
    module.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # no gradient: made zeros, decayed
    e = workers.make_engine(module, cfg.model.actor.optim, cfg, rt, 2)
    assert not e.enable_backward_allreduce  # one rank at ZeRO-0: verlj reduces
    e.enable_backward_allreduce = theirs
    return e

def module_vocab(e):
    return e.module.config.vocab_size

def train(e):
    calls = []
    e.allreduce_gradients = lambda *a, **k: (calls.append(1), type(e).allreduce_gradients(e, *a, **k))
    for step in range(3):
        for micro in range(2):  # accumulated over two micro-batches, as the update does
            ids = torch.randint(0, module_vocab(e), (2, 12), generator=torch.Generator().manual_seed(2 * step + micro))
            loss = e(input_ids=ids, labels=ids).loss
            e.set_gradient_accumulation_boundary(micro == 1)
            e.backward(loss)
            if micro == 1 and not e.enable_backward_allreduce:
                workers.reduce_alone(e)
            e.step()
    return calls, [p.detach().clone() for p in e.module.parameters()], e.optimizer.state_dict()

(c_ds, p_ds, o_ds), (c_v, p_v, o_v) = train(engine(True)), train(engine(False))
assert c_ds and not c_v, (c_ds, c_v)
assert all(torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b) for a, b in zip(p_ds, p_v))
assert not torch.equal(p_v[-1], torch.ones(3))  # the unused parameter was stepped (weight decay)
flat = lambda o: [t for t in torch.utils._pytree.tree_leaves(o) if isinstance(t, torch.Tensor)]
assert len(flat(o_ds)) == len(flat(o_v)) > 0 and all(torch.equal(a, b) for a, b in zip(flat(o_ds), flat(o_v)))
print("same bits")
"""


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_at_zero0_reduces_tensor_by_tensor_to_deepspeeds_bits(tmp_path, precision):
    """DeepSpeed's fallback all-reduce at ZeRO-0 copies every gradient into one flat buffer even on one rank
    (4 bytes a parameter at the step's peak in fp32, 2 in bf16); verlj skips it and does what it would to the
    gradients (zeros for a parameter without one). Three steps of two micro-batches each way, from the same
    weights: the same parameters and optimizer state."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REDUCE_ALONE + LEAVE, precision], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env())
    assert out.returncode == 0 and "same bits" in out.stdout, out.stderr[-3000:]


_MASTERS = r"""
import sys, torch, deepspeed
from verlj.engine.config import make_config
from verlj.engine.dist import setup
from verlj.engine.rl import workers
from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm

# a clip that bites (the scaled path) and weight decay; the fused kernel or torch's per-tensor one
cfg = make_config(None, ["trainer.precision=bf16", "model.actor.optim.weight_decay=0.1", "model.actor.optim.grad_clip=" + sys.argv[1],
                         "model.actor.optim.fused=" + sys.argv[2]])
rt = setup(cfg)
torch.use_deterministic_algorithms(True)

def engine(theirs):
    module = load_causal_lm(BUILTIN_TINY, cfg, 0)
    module.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # no gradient: a zero one, decayed
    if theirs:  # DeepSpeed's own engine: its optimizer's state made, and each step taken, with every fp32 gradient at once
        params = list(module.parameters())
        e = deepspeed.initialize(model=module, model_parameters=params, config=workers.ds_config(cfg.model.actor.optim, cfg, rt, 2, 0))[0]
        assert "step" not in vars(e.optimizer)
        return e
    e = workers.make_engine(module, cfg.model.actor.optim, cfg, rt, 2)
    assert e.optimizer.step.__func__ is workers.step_masters_one_by_one  # verlj steps the masters at ZeRO-0 in bf16
    return e

def train(e):
    peaks = []
    for step in range(3):
        for micro in range(2):
            ids = torch.randint(0, e.module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2 * step + micro))
            e.set_gradient_accumulation_boundary(micro == 1)
            e.backward(e(input_ids=ids, labels=ids).loss)
            if micro == 1 and not e.enable_backward_allreduce:
                workers.reduce_alone(e)
            inner = e.optimizer.optimizer
            seen = []
            orig = type(inner).step
            inner.step = lambda *a, **k: (seen.append(sum(p.grad is not None for g in e.optimizer.fp32_groups for p in g)), orig(inner, *a, **k))[1]
            e.step()
            del inner.step
            peaks += seen
    return (peaks, [p.detach().clone() for p in e.module.parameters()], e.optimizer.state_dict(), e.optimizer._global_grad_norm)

(p_ds, w_ds, o_ds, n_ds), (p_v, w_v, o_v, n_v) = train(engine(True)), train(engine(False))
masters = sum(len(g) for g in engine(False).optimizer.fp32_groups)
assert set(p_ds) == {masters} and set(p_v) == {1}, (set(p_ds), set(p_v))  # fp32 gradients alive at each inner step
assert n_ds == n_v and n_ds > 0
assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(w_ds, w_v))
assert not torch.equal(w_v[-1], torch.ones(3, dtype=w_v[-1].dtype))  # the unused parameter was stepped (weight decay)
flat = lambda o: [t for t in torch.utils._pytree.tree_leaves(o) if isinstance(t, torch.Tensor)]
assert len(flat(o_ds)) == len(flat(o_v)) > 0 and all(torch.equal(a, b) for a, b in zip(flat(o_ds), flat(o_v)))
print("same bits")
"""


@pytest.mark.parametrize("clip,fused", [("0.01", "true"), ("0.0", "false")])
def test_bf16_masters_are_stepped_one_by_one_to_deepspeeds_bits(tmp_path, clip, fused):
    """DeepSpeed's bf16 step at ZeRO-0 makes every master's fp32 gradient before stepping any (4 bytes a
    parameter at the update's peak); verlj makes and drops them one master at a time. Three steps of two
    micro-batches each way, from the same weights: the same bf16 weights, fp32 masters, moments and norm,
    with a clip that scales the gradients and without, on the fused kernel and torch's per-tensor one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MASTERS + LEAVE, clip, fused], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env())
    assert out.returncode == 0 and "same bits" in out.stdout, out.stderr[-3000:]
