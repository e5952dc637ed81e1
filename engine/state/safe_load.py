"""Loading DeepSpeed's files without unpickling anything but tensors and a short allowlist.

DeepSpeed writes its checkpoints with ``torch.save``; verlj reads them back through
:class:`SafeCheckpointEngine`, which wraps the engine's checkpoint engine and loads with
``torch.load(weights_only=True)``. The same wrapper can defer saves (async snapshots): it holds the
live tensors, which a background thread writes while the loop goes on (loop.checkpointer).

Enum members, whichever Python wrote them. Python 3.11.0-3.11.4 pickle a member of an enum with a
mixed-in type (DeepSpeed's ``ZeroStageEnum(int, Enum)``, in every ZeRO 1-3 optimizer state) by name,
as ``getattr(ZeroStageEnum, "optimizer_states")``; 3.10, 3.11.5+ and 3.12+ pickle it by value, as
``ZeroStageEnum(1)``. The weights-only loader refuses the global ``getattr``, so on those
interpreters every ZeRO 1-3 snapshot was one verlj's own loader refused. Two halves fix it:

- :func:`save_portable` (every ``torch.save`` of DeepSpeed state in verlj) pickles every enum member by value,
  whichever Python runs it, so what verlj writes is the same form everywhere;
- the loader maps the by-name form of the allowlisted enums (``_BY_NAME``) to their members, and
  nothing else: the name ``builtins.getattr`` in a checkpoint resolves to :func:`_enum_member`,
  which refuses any class but those enums and any name but a member's. Snapshots already written
  under 3.11.0-3.11.4 load on every interpreter.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import importlib
import pickle
import platform
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import SnapshotError

# DeepSpeed's checkpoints hold a few plain records besides tensors; these alone may be rebuilt.
_SAFE_GLOBAL_NAMES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


# The enums whose members may arrive pickled by name (getattr(cls, name)): see the module's docstring.
_BY_NAME = ("deepspeed.runtime.zero.config.ZeroStageEnum",)


def _resolve(dotted: str):
    mod, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _enum_member(cls, name):
    """What ``builtins.getattr`` means in a checkpoint: a member of an allowlisted enum, by name; nothing else."""
    if not (isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}" in _BY_NAME and isinstance(name, str)
            and name in cls.__members__):
        raise pickle.UnpicklingError(f"refusing getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r}): only a "
                                     f"member of {', '.join(d.rpartition('.')[2] for d in _BY_NAME)} may be named")
    return cls[name]


def safe_globals() -> list:
    return [_resolve(dotted) for dotted in _SAFE_GLOBAL_NAMES] + [(_enum_member, "builtins.getattr")]


class _ByValuePickler(pickle.Pickler):
    """Pickles every enum member by value (cls, (value,)), as Python 3.12 does, on every interpreter."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return type(obj), (obj._value_,)
        return NotImplemented


_BY_VALUE = types.ModuleType("verlj_pickle_by_value")  # torch.save's pickle_module: pickle with that Pickler
_BY_VALUE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")}, Pickler=_ByValuePickler)


def save_portable(obj, path, zipfile: bool = True) -> None:
    """``torch.save`` with enum members pickled by value: the form every interpreter's loader reads."""
    torch.save(obj, path, pickle_module=_BY_VALUE, _use_new_zipfile_serialization=zipfile)


def load_error(e: BaseException) -> str:
    """What a failed weights-only load says, in one short line: torch wraps the refusal (which global,
    which call) in a paragraph of advice to load with weights_only=False, which verlj never does."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


def load_weights_only(path, map_location=None, mmap: bool = False):
    with torch.serialization.safe_globals(safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def _count_tensors(obj) -> int:
    count, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            count += 1
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return count


def tensor_counts(path: Path) -> tuple[int, int]:
    """Open a DeepSpeed file weights-only (memory-mapped): (model tensors, optimizer tensors)."""
    obj = load_weights_only(path, map_location="cpu", mmap=True)
    if "optim_states" in path.name:
        return 0, _count_tensors(obj)
    optim = obj.get("optimizer") if isinstance(obj, dict) else None  # ZeRO-0 keeps it beside the weights
    return _count_tensors(obj.get("module") if isinstance(obj, dict) else obj), _count_tensors(optim)


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


def _rebuild(obj, leaf):
    """`obj`'s containers rebuilt around leaf(x) of everything else: dicts keep their kind, a named tuple
    stays one, a torch.Size (a parameter's shape) is a leaf."""
    if isinstance(obj, dict):
        return type(obj)({k: _rebuild(v, leaf) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_rebuild(v, leaf) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        items = [_rebuild(v, leaf) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return leaf(obj)


def _held(obj):
    """A state dict as an async snapshot holds it until written: its tensors the live ones (no copy:
    the loop does not change them before the next update, which waits for the write: Checkpointer.settle),
    everything else copied."""
    return _rebuild(obj, lambda x: x.detach() if isinstance(x, torch.Tensor) else copy.deepcopy(x))


def saveable(obj):
    """What DeepSpeed hands torch.save (its clone_tensors_for_torch_save: every tensor a storage of its
    own on the host) without copying a tensor that already is one: a view into a larger buffer, a second
    name for a storage already met (tied weights) and a device tensor are copied, the rest saved as they
    are. torch.save writes the same bytes for both."""
    seen: set[int] = set()

    def tensor(x):
        if not isinstance(x, torch.Tensor):
            return x
        storage = x.untyped_storage()
        whole = x.storage_offset() == 0 and x.is_contiguous() and storage.nbytes() == x.numel() * x.element_size()
        if x.device.type != "cpu":
            return x.detach().to("cpu")
        if whole and storage.data_ptr() not in seen and x.numel():
            seen.add(storage.data_ptr())
            return x
        return x.detach().clone()

    return _rebuild(obj, tensor)


class SafeCheckpointEngine:
    """Wraps DeepSpeed's checkpoint engine: loads with weights_only=True; can defer saves to memory (deferring)."""

    def __init__(self, base):
        self._base = base
        self._deferred: list[tuple[str, object]] | None = None  # while deferring: the saves held, in order

    def __getattr__(self, name):
        return getattr(self._base, name)

    def _torch(self) -> bool:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        return isinstance(self._base, TorchCheckpointEngine)

    def preserves_storage_sharing(self) -> bool:
        """Whether DeepSpeed must copy every tensor before save() (its clone_tensors_for_torch_save: the whole
        state again, 12 bytes a parameter in fp32 at ZeRO-0, at a snapshot's peak): not for torch.save, which
        save() hands a `saveable` state (copies of views, second names and device tensors only: the same
        bytes), at once or, when deferring, in the background write."""
        return not self._torch() and self._deferred is None and self._base.preserves_storage_sharing()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[list[tuple[str, object]]]:
        """Within: every save is held in memory, not written (its live tensors: _held), and gathered, as
        (path, state), in the list this yields: an async snapshot writes them in the background."""
        held: list[tuple[str, object]] = []
        self._deferred = held
        try:
            yield held
        finally:
            self._deferred = None

    def save(self, state_dict, path: str):
        if self._deferred is not None:
            self._deferred.append((path, _held(state_dict)))
            return None
        if self._torch():  # what it does, with enums pickled by value
            return save_portable(saveable(state_dict), path, self._base.zipfile_serialization)
        return self._base.save(state_dict, path)

    def load(self, path: str, map_location=None):
        try:
            return load_weights_only(path, map_location=map_location)
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged or foreign file
            raise SnapshotError(f"cannot load {path} on Python {platform.python_version()}: {load_error(e)}") from None


def install_safe_checkpointing(engine) -> SafeCheckpointEngine:
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine
