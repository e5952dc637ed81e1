"""The hardware in a run's identity: the CPU kernel level torch dispatched to (and the processor's model, its BLAS, the accelerator)
is recorded with the run's versions and shown by `inspect`; a replay, resume or rerun on another kernel level
(forced here with ATEN_CPU_CAPABILITY, one level down, in a fresh interpreter) says so first, in one line, and
`verify --deep` does not call the run damaged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from verlj.engine.state.hardware import hardware
from verlj_testing import train, verlj

LOWER = {"AVX512": "avx2", "AVX2": "default"}  # ATEN_CPU_CAPABILITY values one level below the machine's
HERE = torch.backends.cpu.get_cpu_capability()

pytestmark = pytest.mark.skipif(HERE not in LOWER, reason=f"the CPU kernels here ({HERE}) have no lower level to force")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hw") / "run"
    train(run, "trainer.total_steps=3", "trainer.save_interval=2", check=True)
    return run


def lower(**extra):
    return {"ATEN_CPU_CAPABILITY": LOWER[HERE], **extra}


def test_the_kernel_level_is_recorded_and_shown(run):
    shown = json.loads(verlj("inspect", run, "--json", check=True).stdout)
    assert shown["versions"]["cpu kernels"] == HERE and shown["versions"]["processor"] == hardware()["processor"]
    assert shown["versions"]["blas"] and shown["versions"]["accelerator"] == ("none" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    assert f"cpu kernels {HERE}" in verlj("inspect", run, check=True).stdout


def test_a_replay_on_other_kernels_says_so_first(run):
    exact = verlj("replay", run, "--to-step", 1, check=True)
    assert "step 1: fingerprint" in exact.stdout
    out = verlj("replay", run, "--to-step", 1, **lower())
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: step 1 was produced on {HERE}, replayed on {LOWER[HERE].upper()}: bitwise equality across "
                           "kernel levels is not promised (replay diverged at step 1: "), last


def test_a_resume_on_other_kernels_says_so_and_verify_calls_it_no_damage(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    shutil.rmtree(copy / "step_00003")  # the resume replays step 3 from the snapshot of step 2
    out = train(copy, "trainer.total_steps=4", "trainer.save_interval=2", resume=True, **lower())
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"step 3 was produced on {HERE}, replayed on {LOWER[HERE].upper()}" in out.stderr.strip().splitlines()[-1]
    deep = verlj("verify", copy, "--deep", **lower())
    assert deep.returncode == 0, deep.stdout[-3000:] + deep.stderr[-3000:]
    assert "! replay to step 3: step 3 was produced on" in deep.stdout and "not damage" in deep.stdout
    assert "✗" not in deep.stdout


def test_a_rerun_on_other_kernels_names_them_first(run):
    out = verlj("rerun", run, "--steps", "1:1", **lower())
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"the run was produced on {HERE}, rerun on {LOWER[HERE].upper()}: bitwise equality across kernel levels is not promised", out.stdout
    assert any("step 1: differs at" in x for x in lines), out.stdout
