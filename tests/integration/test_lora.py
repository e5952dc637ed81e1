"""LoRA runs (model.actor.lora_rank > 0): SIGKILLed after a commit and resumed bit-identical to an
uninterrupted run at ZeRO 0 to 3, with vLLM generating and in async mode, a snapshot holding the
adapters and their optimizer state only, vLLM holding the merged weights bit for bit, a changed
base refused on resume, replay and what-if, both exports (merged, adapter) loading with the trained
logits, and a what-if re-training the adapters."""

from __future__ import annotations

import pytest
import torch
from test_hardening import flip, one_line_error, tree

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem.counterfactual import whatif
from verlj.engine.state.safe_load import load_weights_only
from verlj.journal import open_journal_reader
from verlj_testing import TINY, fingerprints, kill_and_resume, train, verlj

LORA = ["model.actor.lora_rank=4", "model.actor.lora_alpha=8", "trainer.total_steps=5", "trainer.save_interval=2"]


ROLLOUTS = {"hf": [], "vllm": ["rollout.engine=vllm", "model.tiny.num_heads=2"], "async": ["rollout.mode=async"]}  # async: the generator process


@pytest.mark.parametrize("stage, rollout", [(0, "hf"), (1, "hf"), (2, "hf"), (3, "hf"), (3, "vllm"), (1, "async")])
def test_lora_killed_and_resumed_is_bit_identical(tmp_path, stage, rollout):
    if rollout == "vllm":
        pytest.importorskip("vllm")
    over = [*LORA, f"distributed.zero_stage={stage}", *ROLLOUTS[rollout]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, None, [*TINY, *over])
    out = kill_and_resume(run, ref, *over, failpoint="journal.after_commit:3")
    assert "Replayed step 3 from the journal" in out.stdout + out.stderr and len(fingerprints(ref)) == 5
    with open_journal_reader(run / "journal") as j:
        engines = {(e["engine"], e.get("mode", "sync")) for _, e in j.iter_events("rollout")}  # a sync run's names no mode
    assert engines == {("vllm" if rollout == "vllm" else "hf", "async" if rollout == "async" else "sync")}
    actor = run / "step_00004" / "actor"
    (states_file,) = actor.glob("*model_states.pt")  # ZeRO-3 names it zero_pp_rank_0_mp_rank_00_model_states.pt
    states = load_weights_only(states_file)
    assert states["module"] and all(".lora_A." in n or ".lora_B." in n for n in states["module"])
    if stage == 0:  # the adapters alone, and Adam's moments of them alone
        moments = states["optimizer"]["state"]
        assert len(moments) == len(states["module"])
    else:  # the fp32 partition of what the optimizer trains: the adapters' elements
        optim = load_weights_only(next(actor.glob("*optim_states.pt")))["optimizer_state_dict"]
        flat = optim["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
        n = sum(t.numel() for t in flat)
        assert 0 < n == sum(s.numel() for group in states["param_shapes"] for s in group.values())
        assert all(".lora_" in name for group in states["param_shapes"] for name in group)


def test_lora_exports_load_with_the_trained_logits_and_whatif_retrains(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verlj.engine.config import config_from_dict
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.post_mortem.materialize import materialize
    from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm
    from verlj.engine.state.seeding import derive_seed

    run = tmp_path / "run"
    run_train(run, None, [*TINY, *LORA, "trainer.total_steps=2"])
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    out = verlj("replay", run, "--to-step", "2", "--export", merged, "--export-adapter", adapter)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exported the LoRA adapters" in out.stdout
    replayed = materialize(run, 2)
    try:
        trained = replayed.run.trainer.actor.module.eval()
        ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 4]])
        with torch.no_grad():
            want = trained(input_ids=ids).logits
            full = AutoModelForCausalLM.from_pretrained(merged).eval()
            torch.testing.assert_close(full(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
            ledger = Ledger.open_reader(run)
            cfg = config_from_dict(ledger.config_at(2))
            ledger.close()
            base = load_causal_lm(BUILTIN_TINY, cfg, derive_seed(cfg.trainer.seed, 0, "init/actor"))
            adapted = PeftModel.from_pretrained(base, adapter).eval()
            assert torch.equal(adapted(input_ids=ids).logits, want)
            with trained.disable_adapter():
                assert not torch.allclose(trained(input_ids=ids).logits, want)  # the adapters did train
    finally:
        replayed.run.trainer.close()
    one_line_error(verlj("replay", run, "--to-step", "2", "--export-adapter", merged), 1, "exists and is not empty")
    # a what-if re-trains the adapters on the run's samples: its own config gives the run's fingerprint, a changed lr another
    assert whatif(run, 1, 2, tmp_path / "same", []) == (2, 2)
    assert whatif(run, 1, 2, tmp_path / "lr", ["model.actor.optim.lr=0.003", "algorithm.name=rloo"]) == (2, 2)
    assert fingerprints(tmp_path / "same")[2] == fingerprints(run)[2] != fingerprints(tmp_path / "lr")[2]


def test_changed_base_is_refused_on_resume_replay_and_whatif(tmp_path):
    from test_train_cli import save_tiny_hf

    save_tiny_hf(tmp_path / "base", "lm")
    run = tmp_path / "run"
    over = [f"model.actor.model_name_or_path={tmp_path / 'base'}", "model.actor.lora_rank=2", "data.max_prompt_length=16"]
    out = train(run, *over, "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    flip(next((tmp_path / "base").glob("*.safetensors")))
    before = tree(run)
    changed = "differs from the one this run's LoRA adapters were trained on"
    one_line_error(train(run, *over, "trainer.total_steps=3", resume=True), 1, changed)
    # replay, export and what-if start from a snapshot of the adapters alone: refused on another base too
    one_line_error(verlj("replay", run, "--to-step", "2", "--export", tmp_path / "merged"), 1, changed)
    one_line_error(verlj("whatif", run, "--from-step", "1", "-o", tmp_path / "w", "model.actor.optim.lr=0.003"), 1, changed)
    assert tree(run) == before and not (tmp_path / "merged").exists() and not (tmp_path / "w").exists()


def _vllm_weights(worker) -> dict[str, torch.Tensor]:
    """Runs inside vLLM's worker: the model's weights as vLLM computes with them. On CPU vLLM packs each
    linear layer's weight into its GEMM kernel's layout and empties the parameter; the layer's own GEMM
    applied to the identity gives it back (one nonzero product per fp32 sum: exact)."""
    held = {}
    for name, m in worker.model_runner.get_model().named_modules():
        w = getattr(m, "weight", None)
        if w is None:
            continue
        if w.numel() == 0 and hasattr(m, "cpu_linear"):
            eye = torch.eye(m.input_size_per_partition, dtype=w.dtype)
            w = m.cpu_linear(eye, m.weight, None).t()
        held[f"{name}.weight"] = w.detach().cpu().clone()
    return held


def _as_vllm_holds(merged: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights under vLLM's Llama names: q, k, v stacked into qkv_proj, gate and up
    into gate_up_proj (vLLM's own fused layers), every other weight as it is."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    parts: dict[str, list[torch.Tensor]] = {}
    for name, t in merged:
        owner, _, leaf = name.rpartition(".")
        prefix, _, layer = owner.rpartition(".")
        parts.setdefault(".".join(filter(None, (prefix, fused.get(layer, layer), leaf))), []).append(t)
    return {n: torch.cat(ts) for n, ts in parts.items()}


def test_vllm_generates_from_the_merged_weights():
    """rollout.engine=vllm: each push is the merged weights, bit for bit what vLLM then holds, and vLLM's
    log-probs of its own samples are the adapted actor's (without the push they are another policy's:
    test_vllm's stale check)."""
    pytest.importorskip("vllm")
    from test_vllm import VLLM, _gap, _steps

    from verlj.engine.config import make_config
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.rl import lora
    from verlj.engine.rl.trainer import Trainer

    cfg = make_config(None, [*TINY, *VLLM, *LORA])
    rt = setup(cfg)
    configure_determinism(cfg)
    tr = Trainer(cfg, rt)
    try:
        _steps(tr, 1, 3)
        assert tr.rollout.name == "vllm" and tr.rollout.pushes == 2
        tr.rollout.sync(tr.cfg)  # step 3's update pushed
        assert tr.rollout.pushes == 3
        merged = lora.merged_weights(tr.actor.module)
        held = tr.rollout.llm.collective_rpc(_vllm_weights)[0]
        want = _as_vllm_holds(merged)
        assert sorted(held) == sorted(want)
        held = {n: t[: len(want[n])] for n, t in held.items()}  # vLLM pads the vocabulary's rows
        assert all(torch.equal(held[n], want[n]) for n in want)
        with tr.actor.module.disable_adapter():  # the adapters moved the weights vLLM holds off the base's
            base = _as_vllm_holds([(n.removeprefix(lora.PREFIX).replace(".base_layer", ""), p.detach())
                                   for n, p in tr.actor.module.named_parameters() if ".lora_" not in n])
        assert not all(torch.equal(held[n], base[n]) for n in want)
        gap, _, _ = _gap(tr, [tr.prompt_ids[i] for i in range(8)], list(range(100, 108)))
        assert tr.rollout.pushes == 3 and gap < 1e-4, gap  # generate found nothing to push
    finally:
        tr.close()
