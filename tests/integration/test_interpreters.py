"""ZeRO 1-3 snapshots on this interpreter: saved, verified, resumed exactly, replayed.

DeepSpeed's ZeRO optimizer states hold an int-mixin enum member, which Python 3.11.0-3.11.4 pickle
by name and the others by value (state.safe_load). `tools/interpreters.py` (called by .ci/run) runs
this module and tests/unit/test_safe_load.py under every Python 3.10-3.13 on the machine, and hands
snapshots written under one interpreter to another.
"""

import io
import json
import pickletools
import shutil
import zipfile
from collections import OrderedDict

import pytest
import torch

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem.verify import verify_snapshot
from verlj.engine.state.manifest import MANIFEST, build_manifest
from verlj_testing import TINY, assert_same_journal, fingerprints, pickle_module_reducing, train, verlj

FOUR = ["trainer.total_steps=4", "trainer.save_interval=2"]


def pickled_globals(path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".").replace("__builtin__.", "builtins.")
            for op, arg, _ in pickletools.genops(io.BytesIO(data)) if op.name == "GLOBAL"}


@pytest.mark.parametrize("stage, algo", [(1, "grpo"), (2, "grpo"), (3, "ppo")])
def test_zero_snapshots_verify_resume_and_replay_exactly(tmp_path, stage, algo):
    over = [*TINY, *FOUR, f"distributed.zero_stage={stage}", f"algorithm.name={algo}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, None, over)
    first = train(run, *over[len(TINY):], "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    optim = sorted((run / "step_00002").rglob("*optim_states.pt"))
    assert optim, "a ZeRO 1-3 snapshot holds optimizer partitions"
    for f in optim:  # written in the form every interpreter's loader reads: the enum by value
        assert "builtins.getattr" not in pickled_globals(f)
        assert "deepspeed.runtime.zero.config.ZeroStageEnum" in pickled_globals(f)

    ver = verlj("verify", run)
    assert ver.returncode == 0 and "✗" not in ver.stdout and "Optimizer state loaded" in ver.stdout, ver.stdout + ver.stderr

    out = train(run, *over[len(TINY):], resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Resuming from checkpoint" in out.stdout and "step_00002" in out.stdout
    assert_same_journal(run, ref)

    rep = verlj("replay", run, "--to-step", "3", "--json")
    assert rep.returncode == 0, rep.stderr[-3000:]
    got = json.loads(rep.stdout)
    assert (got["fingerprint"], got["from_snapshot"], got["exact"]) == (fingerprints(ref)[3], 2, True)


def test_an_intact_file_in_a_form_this_python_refuses_is_not_called_damaged(tmp_path):
    """verify tells a file that does not load here (its checksums verify) apart from a damaged one."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from verlj.engine.state.safe_load import load_weights_only

    run = tmp_path / "run"
    run_train(run, None, [*TINY, "trainer.total_steps=2", "trainer.save_interval=2", "distributed.zero_stage=1"])
    snap = tmp_path / "standalone"
    shutil.copytree(run / "step_00002", snap)
    optim = next(snap.rglob("*optim_states.pt"))
    state = load_weights_only(optim)

    refused = pickle_module_reducing(lambda obj: (getattr, (OrderedDict, "fromkeys")) if isinstance(obj, ZeroStageEnum) else None)
    torch.save(state, optim, pickle_module=refused)  # the member as a getattr no loader of verlj's resolves
    (snap / MANIFEST).write_text(json.dumps(build_manifest(snap), indent=1))  # sealed as written: every checksum verifies

    rep, _ = verify_snapshot(snap, None, indexed=False)
    text = "\n".join(rep.lines)
    assert rep.valid, text  # not damaged: nothing skips or quarantines it
    assert "✗" not in text and "refuses a form in it" in text and "not damaged" in text, text
    assert "refusing getattr(OrderedDict, 'fromkeys')" in text, text

    optim.write_bytes(optim.read_bytes()[:-7])  # now damaged: its checksum fails
    rep, _ = verify_snapshot(snap, None, indexed=False)
    assert not rep.valid and any(line.startswith("✗") for line in rep.lines), rep.lines
