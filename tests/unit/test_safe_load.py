"""Enum members in DeepSpeed's files, whichever Python pickled them (state.safe_load).

Python 3.11.0-3.11.4 pickle a member of an int-mixin enum as getattr(cls, name); the others pickle it
by value. These tests make both forms on any interpreter (the by-name one through a pickler that
reduces the member exactly as those interpreters do), so they hold whichever Python runs them.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from collections import OrderedDict

import pytest
import torch
from deepspeed.runtime.zero.config import ZeroStageEnum

from verlj.engine.errors import SnapshotError
from verlj.engine.state.safe_load import SafeCheckpointEngine, load_weights_only, save_portable
from verlj_testing import pickle_module_reducing

# What Python 3.11.0-3.11.4's enum.__reduce_ex__ returns for a member of an int-mixin enum.
BY_NAME = pickle_module_reducing(lambda obj: (getattr, (type(obj), obj._name_)) if isinstance(obj, ZeroStageEnum) else None)


def _state() -> dict:
    return {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": None,
                                     "partition": [torch.arange(6, dtype=torch.float32)]}, "ds_version": "0.19"}


def _globals_in(path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    out = set()
    for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
        if op.name in ("GLOBAL", "STACK_GLOBAL"):
            out.add(arg.replace(" ", ".") if arg else op.name)
    return {g.replace("__builtin__.", "builtins.") for g in out}  # protocol 2 spells builtins so


def test_a_member_pickled_by_name_loads_as_the_member(tmp_path):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(_state(), path, pickle_module=BY_NAME)
    assert "builtins.getattr" in _globals_in(path)  # the form Python 3.11.2 writes
    with pytest.raises(pickle.UnpicklingError):  # what torch's loader alone says of it
        torch.load(path, weights_only=True)
    for loaded in (load_weights_only(path), SafeCheckpointEngine(None).load(str(path))):
        assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states
        assert torch.equal(loaded["optimizer_state_dict"]["partition"][0], torch.arange(6, dtype=torch.float32))


@pytest.mark.parametrize("target", [(OrderedDict, "fromkeys"), (ZeroStageEnum, "mro"), (ZeroStageEnum, "__class__")])
def test_getattr_on_anything_else_is_refused(tmp_path, target):
    cls, name = target
    evil = pickle_module_reducing(lambda obj: (getattr, target) if isinstance(obj, ZeroStageEnum) else None)
    path = tmp_path / "f.pt"
    torch.save(_state(), path, pickle_module=evil)
    with pytest.raises(pickle.UnpicklingError, match="refusing getattr"):
        load_weights_only(path)
    with pytest.raises(SnapshotError, match="refusing getattr"):
        SafeCheckpointEngine(None).load(str(path))


def test_verljs_saves_pickle_members_by_value_on_every_interpreter(tmp_path, monkeypatch):
    # Make this interpreter reduce the member as 3.11.0-3.11.4 do, whatever it is.
    monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
    plain, portable = tmp_path / "plain.pt", tmp_path / "portable.pt"
    torch.save(_state(), plain)
    save_portable(_state(), portable)
    assert "builtins.getattr" in _globals_in(plain)
    assert "builtins.getattr" not in _globals_in(portable)
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in _globals_in(portable)
    monkeypatch.undo()
    with torch.serialization.safe_globals([ZeroStageEnum]):  # torch's own loader reads it: no getattr in it
        assert torch.load(portable, weights_only=True)["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states
    assert load_weights_only(plain)["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states


def test_a_snapshot_copies_only_views_and_second_names_and_writes_what_deepspeed_would():
    """DeepSpeed is told not to copy the state before save (preserves_storage_sharing), sync or deferred;
    deferred, the wrapper holds the live tensors; `saveable` makes only views and second names copies: the
    file, written at once or from what was held, loads to the tensors DeepSpeed's own copy
    (clone_tensors_for_torch_save) gives, each in a storage of its own, of the same size."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from verlj.engine.state.safe_load import saveable

    flat = torch.arange(40, dtype=torch.float32)  # a ZeRO flat buffer and the parameters that are views into it
    tied = torch.randn(3, 4)
    state = OrderedDict(module=OrderedDict(a=flat[:10].view(2, 5), b=flat[10:40], emb=tied, head=tied),
                        optimizer={"state": {0: {"exp_avg": torch.randn(6), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
                        bits=(torch.tensor([1, 2], dtype=torch.int8), ZeroStageEnum.gradients),
                        param_shapes=[OrderedDict(a=torch.Size([2, 5]), b=torch.Size([30]))])
    def ds_clone(st):  # DeepSpeed's copy, the shapes kept as torch.Size (its clone makes them tuples, which verlj does not)
        out = clone_tensors_for_torch_save(OrderedDict((k, v) for k, v in st.items() if k != "param_shapes"))
        out["param_shapes"] = st["param_shapes"]
        return out

    ce = SafeCheckpointEngine(TorchCheckpointEngine())
    assert not ce.preserves_storage_sharing()  # saving now: verlj's save makes it saveable
    now = io.BytesIO()
    ce.save(state, now)
    with ce.deferring() as deferred:
        assert not ce.preserves_storage_sharing()
        ce.save(state, "f")
    (_, held), = deferred
    assert ce.save(state, io.BytesIO()) is None and deferred == [("f", held)]  # deferring is over: that one was written
    assert held["module"]["emb"].data_ptr() == tied.data_ptr() and held["module"]["b"].data_ptr() == flat[10:].data_ptr()  # no copy
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_portable(saveable(held), ours)
    save_portable(ds_clone(state), theirs)
    assert len(ours.getvalue()) == len(theirs.getvalue())
    theirs_now = io.BytesIO()  # in the engine's own serialization
    save_portable(ds_clone(state), theirs_now, ce.zipfile_serialization)
    assert len(now.getvalue()) == len(theirs_now.getvalue())
    a, b, c = (load_weights_only(io.BytesIO(f.getvalue())) for f in (ours, theirs, now))
    assert [k for k, _ in _tensors(c)] == [k for k, _ in _tensors(b)]
    assert all(torch.equal(x, y) and x.stride() == y.stride() for (_, x), (_, y) in zip(_tensors(c), _tensors(b)))
    flat_a = [(k, v) for k, v in _tensors(a)]
    flat_b = [(k, v) for k, v in _tensors(b)]
    assert [k for k, _ in flat_a] == [k for k, _ in flat_b]
    for (k, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y), k
    assert len({x.untyped_storage().data_ptr() for _, x in flat_a}) == len(flat_a)  # no two share a storage, as DeepSpeed's
    assert a["bits"][1] is ZeroStageEnum.gradients and a["optimizer"]["param_groups"] == [{"lr": 0.1}]
    for loaded in (a, c):  # shapes stay torch.Size (DeepSpeed's clone is never given them: a LoRA test reads .numel())
        assert all(type(v) is torch.Size for v in loaded["param_shapes"][0].values()), loaded["param_shapes"]


def _tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}/{i}")
