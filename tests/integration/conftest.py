"""Fixtures shared by the integration tests."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from verlj.engine.loop.run import train as run_train
from verlj_testing import SMALL, ray_worker_server, session_dir, verlj, workers_from


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(dest, overrides, env=None)`: `dest`, a copy of the finished run that `overrides` (the whole
    list, TINY included) make, for a test module of its own to read or change. The run is trained once per
    session, by whichever module asks first, and shared by the xdist workers (in the session's directory, under
    a file lock), keyed by its recipe: the config the overrides resolve to (whatever their order), and how it is
    trained: in this process (run_train) with env=None, else by `verlj train` in a process of its own with `env`
    added to its environment (as train() runs it). The same recipe makes the same run (the same journaled
    events, fingerprints and snapshots), and nobody gets the original: a module that trained it itself before
    gets the run it made."""
    from filelock import FileLock

    from verlj.engine.config import make_config

    root = session_dir(tmp_path_factory) / "reference_runs"
    root.mkdir(exist_ok=True)

    def copy(dest: Path, overrides: list[str], env: dict | None = None) -> Path:
        recipe = json.dumps({"config": make_config(None, list(overrides)).to_stored(), "process": env is not None,
                             "env": sorted((env or {}).items())}, sort_keys=True)
        made = root / hashlib.sha256(recipe.encode()).hexdigest()[:16]
        with FileLock(str(made) + ".lock"):
            if not (made / "recipe.json").is_file():  # a worker that died while making it left no recipe.json
                shutil.rmtree(made, ignore_errors=True)
                if env is None:
                    assert run_train(made / "run", None, list(overrides)).snapshots_failed is None  # as `verlj train` exits 0
                else:
                    verlj("train", "--output-dir", made / "run", *overrides, check=True, **env)
                (made / "recipe.json").write_text(recipe)
        shutil.copytree(made / "run", dest, symlinks=True)
        return dest

    return copy


@pytest.fixture(scope="module")
def base(tmp_path_factory, reference_run):
    """A finished 4-step run (snapshots 2 and 4) of the module's own; copy it before changing it."""
    return reference_run(tmp_path_factory.mktemp("base") / "run", SMALL)


@pytest.fixture
def copy(base, tmp_path):
    """A copy of `base` of the test's own."""
    run = tmp_path / "run"
    shutil.copytree(base, run, symlinks=True)
    return run


class Cluster(dict):
    """A local Ray cluster's address for the `verlj train` subprocesses, which join it through RAY_ADDRESS (the
    dictionary: their environment), and the fork server its workers come from (`server`; None with
    VERLJ_TESTS_FRESH=1)."""

    def __init__(self, address: str, server) -> None:
        super().__init__(RAY_ADDRESS=address)
        self.server = server


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module (started and stopped by this process), its workers forked by a fork
    server of its own (harness.processes.workers_from): a Cluster (test_fleet.py, test_ray_launcher.py)."""
    if os.environ.get("CI"):
        import ray  # in CI a missing ray is a failure, not a skip
    else:
        ray = pytest.importorskip("ray")
    server = ray_worker_server()  # its actors forked, torch and transformers imported (harness.processes.workers_from)
    try:
        with workers_from(server):
            ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", object_store_memory=256 * 1024 * 1024)
        yield Cluster(ray.get_runtime_context().gcs_address, server)
    finally:
        ray.shutdown()
        if server is not None:
            server.stop()
