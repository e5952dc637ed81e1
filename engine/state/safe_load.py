"""Loading DeepSpeed's files without unpickling anything but tensors and a short allowlist.

DeepSpeed writes its checkpoints with ``torch.save``; verlj reads them back through
:class:`SafeCheckpointEngine`, which wraps the engine's checkpoint engine and loads with
``torch.load(weights_only=True)``. The same wrapper can defer saves to host memory (async snapshots).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections import OrderedDict

import torch

from ..errors import SnapshotError

# DeepSpeed's checkpoints hold a few plain records besides tensors; these alone may be rebuilt.
_SAFE_GLOBAL_NAMES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def safe_globals() -> list:
    out = []
    for dotted in _SAFE_GLOBAL_NAMES:
        mod, _, name = dotted.rpartition(".")
        out.append(getattr(importlib.import_module(mod), name))
    return out


def load_weights_only(path, map_location=None, mmap: bool = False):
    with torch.serialization.safe_globals(safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


@contextlib.contextmanager
def weights_only_everywhere():
    """While inside, every ``torch.load`` (DeepSpeed's universal-checkpoint converter and loader
    call it with weights_only=False) loads tensors and the allowlist only."""
    original = torch.load

    def safe(f, map_location=None, *args, **kwargs):
        kwargs.pop("weights_only", None)
        with torch.serialization.safe_globals(safe_globals()):
            return original(f, map_location, *args, weights_only=True, **kwargs)

    torch.load = safe
    try:
        yield
    finally:
        torch.load = original


def _copy_state(obj):
    """A host-memory copy of a state dict that later training cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _copy_state(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _copy_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_state(v) for v in obj)
    return copy.deepcopy(obj)


class SafeCheckpointEngine:
    """Wraps DeepSpeed's checkpoint engine: loads with weights_only=True; can defer saves to memory."""

    def __init__(self, base):
        self._base = base
        self.deferred: list[tuple[str, object]] | None = None

    def __getattr__(self, name):
        return getattr(self._base, name)

    def save(self, state_dict, path: str):
        if self.deferred is not None:
            self.deferred.append((path, _copy_state(state_dict)))
            return None
        return self._base.save(state_dict, path)

    def load(self, path: str, map_location=None):
        try:
            return load_weights_only(path, map_location=map_location)
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged or foreign file
            raise SnapshotError(f"cannot load {path}: {str(e).splitlines()[0][:200]}") from None


def install_safe_checkpointing(engine) -> SafeCheckpointEngine:
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine
