"""LoRA on the built-in model without DeepSpeed (rl.lora): the keys, the adapters' placement and
seed, the reference as the base with adapters off, the merged weights under the base's names."""

from __future__ import annotations

import pytest
import torch

from verlj.engine.config import ConfigError, make_config
from verlj.engine.errors import ModelError
from verlj.engine.rl import lora
from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm


def _cfg(*over: str):
    return make_config(None, ["model.actor.lora_rank=4", "model.actor.lora_alpha=8", *over])


def _tiny(cfg):
    return load_causal_lm(BUILTIN_TINY, cfg, 7)


def _trained(cfg, seed: int = 3):
    """The tiny model with adapters whose B is non-zero (as after some updates)."""
    model, base = lora.adapt(_tiny(cfg), cfg, seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval(), base


def _ids():
    return torch.tensor([[1, 5, 6, 7, 8, 9, 4, 3]])


def test_keys_are_read_and_checked():
    assert make_config(None, []).model.actor.lora_rank == 0  # off by default
    assert _cfg().model.actor.target_modules == "all-linear"
    assert _cfg("model.actor.target_modules=[q_proj,v_proj]").model.actor.target_modules == ["q_proj", "v_proj"]
    for bad, says in (("model.actor.lora_rank=-1", "lora_rank"), ("model.actor.target_modules=attention", "all-linear or a list"),
                      ("model.actor.target_modules=[]", "empty list"), ("model.actor.lora_alpha=0", "lora_alpha"),
                      ("distributed.tensor_parallel_size=2", "tensor parallelism")):
        with pytest.raises(ConfigError, match=says):
            _cfg(bad)


def test_adapters_train_alone_and_start_as_the_base():
    cfg = _cfg("model.actor.target_modules=[q_proj,v_proj]")
    base = _tiny(cfg)
    want = base(_ids()).logits
    model, ident = lora.adapt(_tiny(cfg), cfg, 3)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert torch.equal(model(_ids()).logits, want)  # B = 0: the first policy is the base
    again, ident2 = lora.adapt(_tiny(cfg), cfg, 3)
    assert ident == ident2 and ident["actor_base_path"] == BUILTIN_TINY
    a = dict(model.named_parameters())
    assert all(torch.equal(p, a[n]) for n, p in again.named_parameters())  # A from the seed
    other, _ = lora.adapt(_tiny(cfg), cfg, 4)
    assert not all(torch.equal(p, a[n]) for n, p in other.named_parameters())


def test_reference_is_the_base_with_adapters_off():
    cfg = _cfg()
    want = _tiny(cfg)(_ids()).logits
    model, _ = _trained(cfg)
    assert not torch.allclose(model(_ids()).logits, want)
    with model.disable_adapter():
        assert torch.equal(model(_ids()).logits, want)


def test_merged_weights_load_into_the_base_model():
    cfg = _cfg()
    model, _ = _trained(cfg)
    merged = dict(lora.merged_weights(model))
    plain = _tiny(cfg)
    assert list(merged) == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(plain.eval()(_ids()).logits, model(_ids()).logits, rtol=1e-5, atol=1e-5)
    unchanged = dict(_tiny(cfg).named_parameters())
    assert torch.equal(merged["lm_head.weight"], unchanged["lm_head.weight"])  # all-linear leaves the head alone
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], unchanged["model.layers.0.self_attn.q_proj.weight"])


def test_unknown_target_module_is_one_sentence():
    cfg = _cfg("model.actor.target_modules=[nope_proj]")
    with pytest.raises(ModelError, match="model.actor.target_modules"):
        lora.adapt(_tiny(cfg), cfg, 3)


def test_changed_base_is_refused():
    lora.check_base(None, {}, "x")  # a run without LoRA (or from before): nothing to check
    lora.check_base("abc", {"actor_base_digest": "abc"}, "x")
    with pytest.raises(ModelError, match="differs from the one this run's LoRA adapters were trained on"):
        lora.check_base("abc", {"actor_base_digest": "abd"}, "x")


def test_without_peft_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # `import peft` raises ImportError
    cfg = _cfg()
    with pytest.raises(ModelError, match=r"needs the peft package: pip install 'verlj\[lora\]'"):
        lora.adapt(_tiny(cfg), cfg, 3)
    assert lora.adapt(model := _tiny(make_config(None, [])), make_config(None, []), 3) == (model, {})  # off: peft not needed
