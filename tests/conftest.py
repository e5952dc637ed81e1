import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Fixed thread count and deterministic kernels for every test process (and children, via env).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

# The suite's two tiers. `python -m pytest` runs every test (CI); `python -m pytest -m "not slow"`, the everyday
# tier, leaves out the tests marked slow: the modules whose tests take longest, by SECONDS below, which are
# measured, never guessed. Each test module's seconds in a full run of the suite (its tests' setup, call and
# teardown summed: the time the module holds an xdist worker), and the calls of the few tests that take long
# in a module that does not, as `python -m pytest --measure-seconds FILE` writes them (FILE: JSON, the same
# keys); the numbers below come from the full run named in SECONDS_MEASURED. A module or test over
# SLOW_SECONDS is marked slow. Every test module is listed (tests/unit/test_suite_layout.py checks it, and that
# every name listed exists): after adding one, measure it (`python -m pytest -n 0 tests/integration/test_x.py
# --measure-seconds /tmp/s.json` gives its seconds alone; the next full run, the figure to keep).
SECONDS_MEASURED = "provisional"
SLOW_SECONDS = 30
SECONDS = {
    "test_fleet.py": 280,
    "test_ray_launcher.py": 180,
    "test_reshard.py": 166,
    "test_node_loss.py": 142,
    "test_async.py": 139,
    "test_whatif.py": 130,
    "test_vllm.py": 125,
    "test_recovery.py": 101,
    "test_hardening.py": 97,
    "test_shipping.py": 87,
    "test_async_completion.py": 83,
    "test_distributed.py": 82,
    "test_interpreters.py": 80,
    "test_faults_quick.py": 45,
    "test_retention.py": 62,
    "test_view_browser.py": 60,
    "test_examples.py": 60,
    "test_verify_inspect.py": 56,
}


def slow(nodeid: str) -> bool:
    """Whether the test `nodeid` (tests/DIR/test_x.py::test_name[params]) is in the slow tier: its module's
    seconds, or its own, over SLOW_SECONDS."""
    module, _, name = nodeid.rsplit("/", 1)[-1].partition("::")
    return max(SECONDS.get(module, 0), SECONDS.get(f"{module}::{name.split('[')[0]}", 0)) > SLOW_SECONDS


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # xdist (--dist loadscope: one test module per worker at a time) hands out the modules with the most tests
    # first, so the unit modules mix with the long multi-process ones; this order, longest first, only breaks
    # its ties. Handing out the longest first instead (--no-loadscope-reorder) made a clean-clone CI slower (33
    # min, against 27 for the CI before it): two multi-process modules at once on two cores slowed each other.
    items.sort(key=lambda item: -SECONDS.get(item.path.name, 0))  # stable: the rest keep their order


def pytest_addoption(parser):
    parser.addoption("--measure-seconds", metavar="FILE", default=None,
                     help="write each test module's seconds (its tests' setup, call and teardown summed), and each "
                          "test function's calls, to FILE as JSON: what SECONDS in tests/conftest.py holds")


_MEASURED: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module, _, name = report.nodeid.rsplit("/", 1)[-1].partition("::")
    _MEASURED[module] = _MEASURED.get(module, 0.0) + report.duration
    if report.when == "call":
        test = f"{module}::{name.split('[')[0]}"
        _MEASURED[test] = _MEASURED.get(test, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--measure-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, which gets every worker's reports
        import json

        seconds = {k: round(v, 1) for k, v in sorted(_MEASURED.items(), key=lambda kv: -kv[1])}
        Path(path).write_text(json.dumps(seconds, indent=1) + "\n")


@pytest.fixture(scope="session")
def bpe_model(tmp_path_factory) -> str:
    """A Qwen2-shaped model with a real tokenizer, made locally (examples/make_bpe_model.py: a byte-level BPE
    trained by `tokenizers`, a ChatML template with hermes tool calls, <|im_end|> as its end of sequence): the
    directory, for model.actor.model_name_or_path. Made once per session and shared by the xdist workers
    (their common base directory, under a file lock); the same bytes every time."""
    import hashlib
    import shutil

    from filelock import FileLock

    maker = REPO / "examples" / "make_bpe_model.py"
    root = tmp_path_factory.getbasetemp().parent  # every worker's basetemp is under it
    out = root / f"bpe_model-{hashlib.sha256(maker.read_bytes()).hexdigest()[:12]}"  # made anew when the recipe changes
    with FileLock(str(root / "bpe_model.lock")):
        if not (out / "model.safetensors").is_file():
            make_bpe_model = _recipe().make_bpe_model
            made = root / f"{out.name}.tmp"
            shutil.rmtree(made, ignore_errors=True)
            make_bpe_model(made)
            made.rename(out)
    return str(out)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """The bpe_model's tokenizer alone (its byte-level BPE and ChatML template; the same, made in two seconds without the
    model's weights), for what needs no model."""
    return _recipe().make_tokenizer()


def _recipe():
    """examples/make_bpe_model.py, imported from the repository's root."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module("examples.make_bpe_model")
    finally:
        sys.path.remove(str(REPO))
