"""What engine/rl/vllm_engine.py decides without vLLM: the actor's head size its CPU attention is asked to run, and
the weights copies a killed vLLM start leaves behind (named by the process that wrote them: only those whose
process is gone are stale, and removed). Generating with vLLM: tests/integration/test_vllm.py.

    python -m pytest -n 0 tests/unit/test_vllm_engine.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from verlj.engine.config import make_config
from verlj.engine.rl.vllm_engine import (
    COPY_DIR_ENV,
    COPY_PREFIX,
    CPU_HEAD_SIZES,
    head_size,
    remove_stale_weights_copies,
    stale_weights_copies,
)
from verlj.journal.claim import process_start


def test_the_builtin_models_head_size_and_where_it_comes_from():
    cfg = make_config(None, ["model.tiny.num_heads=2"])
    t = cfg.model.tiny
    assert head_size(cfg) == (t.hidden_size // 2, f"model.tiny.hidden_size {t.hidden_size} / model.tiny.num_heads 2")
    assert head_size(cfg)[0] in CPU_HEAD_SIZES and head_size(make_config(None, ["model.tiny.num_heads=4"]))[0] not in CPU_HEAD_SIZES


def test_only_the_copies_of_processes_gone_are_stale_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv(COPY_DIR_ENV, str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = process_start(gone.pid)
    gone.wait()
    me = os.getpid()
    dead = tmp_path / f"{COPY_PREFIX}{gone.pid}-{started}-abcd"  # its process ended
    reused = tmp_path / f"{COPY_PREFIX}{me}-1-abcd"  # its pid now another process's (another start time)
    live = tmp_path / f"{COPY_PREFIX}{me}-{process_start(me)}-abcd"  # this process's own
    other = tmp_path / f"{COPY_PREFIX}notours"
    for d in (dead, reused, live, other):
        d.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 2**20)
    assert sorted(stale_weights_copies()) == sorted([(dead, 2**20), (reused, 0)])
    assert sorted(remove_stale_weights_copies()) == sorted([f"Removed {dead} (1.0 MiB): a weights copy left by a killed vLLM start",
                                                            f"Removed {reused} (0.0 MiB): a weights copy left by a killed vLLM start"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
