"""The fingerprint of a run's trained state: BLAKE3 over every rank's parameters, optimizer and
LR-scheduler state, in a fixed order. Journaled after every step; replay must reproduce it bit for bit."""

from __future__ import annotations

import blake3
import torch

from ..dist import Runtime


def _hash_tree(h: blake3.blake3, obj, path: str = "") -> None:
    """Feed every tensor and scalar of a nested state (dicts in sorted key order) into h."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            t = t.cpu()
        t = t.contiguous()
        h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _hash_tree(h, obj[k], f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _hash_tree(h, v, f"{path}/{i}")
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        h.update(f"{path}={obj!r}".encode())
    # other objects (enums, configs inside optimizer states) do not carry training state


def engine_digest(engine) -> str:
    """This rank's share of an engine's state: parameters (ZeRO-3 partitions), optimizer, LR scheduler."""
    h = blake3.blake3()
    for name, p in engine.module.named_parameters():
        _hash_tree(h, p.ds_tensor if hasattr(p, "ds_tensor") else p, "param/" + name)
    _hash_tree(h, engine.optimizer.state_dict(), "optim")
    if engine.lr_scheduler is not None:
        _hash_tree(h, engine.lr_scheduler.state_dict(), "sched")
    h.update(f"global_steps={engine.global_steps}".encode())
    return h.hexdigest()


def fingerprint(engines: dict[str, object], rt: Runtime) -> tuple[str, dict[str, str]]:
    """A digest of the whole trained state across ranks: (fingerprint, {part: digest})."""
    local = {name: engine_digest(e) for name, e in engines.items()}
    per_rank = rt.all_gather_obj(local)
    parts = {name: blake3.blake3("|".join(r[name] for r in per_rank).encode()).hexdigest() for name in engines}
    fp = blake3.blake3("|".join(f"{k}={parts[k]}" for k in sorted(parts)).encode()).hexdigest()
    return fp, parts
