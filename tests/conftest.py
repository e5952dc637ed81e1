import os

# Fixed thread count and deterministic kernels for every test process (and children, via env).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

# The suite runs on two workers (pytest-xdist, one test module per worker at a time: addopts in
# pyproject.toml, whose --no-loadscope-reorder keeps this order: xdist would otherwise hand out the modules
# with the most tests first). Modules are handed out in collection order, so the longest start first and no
# worker is left alone with a long one at the end. Seconds of their slowest tests, measured on 2 cores with
# the fork server (tests/forkserver.py), the other worker busy.
LONGEST_FIRST = [
    "test_async.py",  # 263
    "test_reshard.py",  # 242
    "test_fleet.py",  # 184 (a Ray cluster and nine runs)
    "test_vllm.py",  # 191
    "test_distributed.py",  # 187
    "test_episodes.py",  # 164
    "test_recovery.py",  # ~150
    "test_hardening.py",  # ~150
    "test_shipping.py",  # 129
    "test_node_loss.py",  # 111
    "test_async_completion.py",  # 99
    "test_interpreters.py",  # 83
    "test_ray_launcher.py",  # 80 (a Ray cluster, torchrun's 2 ranks, 2 Ray runs of 2 ranks)
    "test_faults_quick.py",  # 71
    "test_rerun.py",
    "test_retention.py",
    "test_examples.py",
    "test_whatif.py",
    "test_verify_inspect.py",
    "test_projections.py",
    "test_train_cli.py",
    "test_forkserver.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
