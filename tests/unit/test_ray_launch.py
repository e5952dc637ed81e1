"""`verlj train --launcher ray --nproc N` (cli/ray_launch.py) refuses what cannot run before it starts or joins a
cluster or writes the run: one line, exit 2. Ranks placed on a real Ray cluster: tests/integration/test_ray_launcher.py.

    python -m pytest -n 0 tests/unit/test_ray_launch.py
"""

from __future__ import annotations

import os

import pytest
import typer

from verlj.cli.ray_launch import launch
from verlj_testing import TINY


def refused(capsys, run, overrides, nproc=2) -> str:
    def train(**kwargs):
        raise AssertionError("no rank may train")

    with pytest.raises(typer.Exit) as out:
        launch(run, None, [*TINY, *overrides], False, False, nproc, 0, train)
    assert out.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not run.exists(), err
    return err[0]


@pytest.fixture
def ray(monkeypatch):
    """ray importable (in CI a missing ray is a failure, not a skip), with no cluster named, and the variables
    the launcher sets for Ray's log lines restored after the test."""
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray")
    for name in ("RAY_ADDRESS", "RAY_DEDUP_LOGS", "RAY_COLOR_PREFIX"):
        monkeypatch.setenv(name, "")  # recorded as it was (set or not), to be put back after the test
        monkeypatch.delenv(name)
    return ray


def test_a_fleet_on_two_ranks_is_refused_before_a_cluster_is_started(tmp_path, capsys, ray):
    said = refused(capsys, tmp_path / "run", ["rollout.mode=async", "rollout.fleet=ray"])
    assert said == ("error: rollout.fleet=ray runs with one trainer rank in this version, and this job has 2: train on one "
                    "(--launcher ray --nproc 1, or no torchrun) or set rollout.fleet=none")
    assert not ray.is_initialized()


def test_a_bad_placement_is_refused_before_ray_is_asked(tmp_path, capsys, ray):
    said = refused(capsys, tmp_path / "run", ["distributed.placement=everywhere"])
    assert said.startswith("error: distributed.placement must be one of pack, spread"), said
    assert not ray.is_initialized()
