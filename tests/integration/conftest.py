"""Fixtures shared by the integration tests."""

import os
import shutil

import pytest

from verlj.engine.loop.run import train as run_train
from verlj_testing import SMALL


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (snapshots 2 and 4), made once per test module; copy it before changing it."""
    run = tmp_path_factory.mktemp("base") / "run"
    run_train(run, None, SMALL)
    return run


@pytest.fixture
def copy(base, tmp_path):
    """A copy of `base` of the test's own."""
    run = tmp_path / "run"
    shutil.copytree(base, run, symlinks=True)
    return run


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module (started and stopped by this process); its address for the
    `verlj train` subprocesses, which join it through RAY_ADDRESS (test_fleet.py, test_ray_launcher.py)."""
    if os.environ.get("CI"):
        import ray  # in CI a missing ray is a failure, not a skip
    else:
        ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", object_store_memory=256 * 1024 * 1024)
    try:
        yield {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    finally:
        ray.shutdown()
