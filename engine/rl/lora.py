"""LoRA adapters on the actor (``model.actor.lora_rank > 0``), through ``peft``.

    verlj train --config examples/lora.yaml
    verlj replay runs/lora --to-step 20 --export out/merged --export-adapter out/adapter

The actor's linear layers (``model.actor.target_modules``) get rank-r adapters; the base stays
frozen, so DeepSpeed's optimizer holds the adapters alone (at every ZeRO stage). What follows from it:

- the reference model is the base itself: the same module with its adapters switched off
  (peft's ``disable_adapter()``), no second copy in memory;
- a snapshot holds the adapters and their optimizer state (DeepSpeed's
  ``exclude_frozen_parameters``); the base is named in the run's identity by its path and the
  digest of its weights (:func:`base_identity`), and a changed base is refused on resume;
- generation engines that hold their own weights (vLLM, generator processes) get the merged
  weights ``W + (alpha / r) B A`` under the base model's own names (:func:`merged_weights`);
  the ``hf`` engine samples from the adapted module itself.

Adapters start as peft makes them (B = 0, so the first policy is the base), their A drawn from
the run's seed: a run starts the same way every time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..config import Config
from ..errors import ModelError, install_hint

PREFIX = "base_model.model."  # where peft puts the wrapped model's own names


def enabled(cfg: Config) -> bool:
    return cfg.model.actor.lora_rank > 0


def _peft():
    try:
        import peft
    except ImportError:
        raise ModelError(f"model.actor.lora_rank needs the peft package: {install_hint('lora')}") from None
    return peft


def wrap(model: nn.Module, cfg: Config, seed: int) -> nn.Module:
    """`model` with LoRA adapters on model.actor.target_modules (its own weights frozen); the
    adapters' initial A from `seed`."""
    peft = _peft()
    a = cfg.model.actor
    conf = peft.LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, target_modules=a.target_modules, lora_dropout=0.0,
                           bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, conf)
        except ValueError as e:  # e.g. target modules the model does not have
            raise ModelError(f"model.actor.target_modules: {str(e).splitlines()[0][:300]}") from None
    for prefix, layer in lora_layers(wrapped):
        if not isinstance(layer.get_base_layer(), nn.Linear) or layer.fan_in_fan_out:
            raise ModelError(f"model.actor.target_modules: {prefix.removeprefix(PREFIX)} is not a linear layer "
                             "(verlj merges LoRA into nn.Linear weights only)")
    return wrapped


def lora_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, peft LoRA layer) of every adapted layer, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, m in module.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


def base_identity(path: str, model: nn.Module) -> dict:
    """The frozen base as the run's identity records it: its path and a digest of its weights
    (a local directory's files, as a frozen reward model's; the built-in model's initial tensors)."""
    from .models import BUILTIN_TINY, model_digest

    if path != BUILTIN_TINY:
        return {"actor_base_path": path, "actor_base_digest": model_digest(path)}
    import blake3

    h = blake3.blake3()
    for name, t in model.state_dict().items():
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"actor_base_path": path, "actor_base_digest": h.hexdigest()}


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole on this rank (a ZeRO-3 partition gathered). Collective at ZeRO-3."""
    if hasattr(p, "ds_tensor"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            return p.detach().clone()
    return p.detach()


def merged_weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapted model's weights merged, under the base model's own names (what
    ``AutoModelForCausalLM`` and vLLM load): each adapted layer's ``W + scaling * B @ A`` (computed in
    fp32, cast back to W's dtype), every other parameter as it is. Collective at ZeRO-3."""
    layers = dict(lora_layers(module))
    params = {name: _whole(p) for name, p in module.named_parameters()}
    out = []
    for name, t in params.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in layers:
            prefix = owner.removesuffix(".base_layer")
            if leaf == "weight":
                layer = layers[prefix]
                (adapter,) = layer.active_adapters
                a = params[f"{prefix}.lora_A.{adapter}.weight"].float()
                b = params[f"{prefix}.lora_B.{adapter}.weight"].float()
                t = (t.float() + (b @ a) * layer.scaling[adapter]).to(t.dtype)
            name = f"{prefix}.{leaf}"
        out.append((name.removeprefix(PREFIX), t))
    return out


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors whole, under the wrapped module's names (what peft's ``save_pretrained``
    takes as ``state_dict`` and turns into an adapter directory's). Collective at ZeRO-3."""
    return {name: _whole(p) for name, p in module.named_parameters() if p.requires_grad}


def adapt(model: nn.Module, cfg: Config, seed: int) -> tuple[nn.Module, dict]:
    """The actor as the run trains it and what the run's identity records of its base: `model`
    itself and {} without LoRA; else `model` with adapters and :func:`base_identity`."""
    if not enabled(cfg):
        return model, {}
    base = base_identity(cfg.model.actor.model_name_or_path, model)
    return wrap(model, cfg, seed), base


def check_base(recorded_digest: str | None, now: dict, path: str) -> None:
    """On resume: the frozen base must be the one the run started with (a snapshot holds the
    adapters only). `recorded_digest`: the run's identity's (None: no LoRA, or a run from before)."""
    if recorded_digest is not None and recorded_digest != now.get("actor_base_digest"):
        raise ModelError(f"model.actor.model_name_or_path: the base model in {path} differs from the one this run's "
                         "LoRA adapters were trained on; restore it, or start a new run")
