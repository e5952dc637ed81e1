"""Fixtures shared by the integration tests."""

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
