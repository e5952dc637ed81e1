import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Fixed thread count and deterministic kernels for every test process (and children, via env).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

# The suite runs on two workers (pytest-xdist, one test module per worker at a time: addopts in
# pyproject.toml). xdist hands out the modules with the most tests first, so the unit modules mix with the
# long multi-process ones; this order only breaks its ties. Handing out the longest first instead
# (--no-loadscope-reorder) made a clean-clone CI slower (33 min, against 27 for the CI before it; the fork
# server's fallback after vLLM's import muddies the comparison): two multi-process modules at once on two
# cores slowed each other (test_fleet's longest test 160 s against 132). Seconds each, measured serially.
LONGEST_FIRST = [
    "test_fleet.py",  # ~280 with other jobs on the cores (new; a Ray cluster and nine runs)
    "test_ray_launcher.py",  # ~180 with other jobs on the cores (new: a Ray cluster, torchrun's 2 ranks, 2 Ray runs of 2 ranks)
    "test_recovery.py",  # 166
    "test_reshard.py",  # 166
    "test_node_loss.py",  # 142
    "test_async.py",  # 139
    "test_whatif.py",  # ~130 (new: estimated from its runs under load)
    "test_vllm.py",  # 125
    "test_hardening.py",  # 97
    "test_shipping.py",  # 87
    "test_async_completion.py",  # 83
    "test_distributed.py",  # 82
    "test_interpreters.py",  # ~80 (new)
    "test_faults_quick.py",  # 66 when measured; 45 since it runs three kinds
    "test_retention.py",  # 62
    "test_view_browser.py",  # ~60 (new: three runs, a what-if, a resume, headless Chromium)
    "test_examples.py",  # 60
    "test_verify_inspect.py",  # 56
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


import pytest  # noqa: E402


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
