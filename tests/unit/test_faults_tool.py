"""tools/faults.py's own logic that the campaign relies on: a wrong --kinds or --python is one line, and the fleet
kind's count of actor deaths across trainer restarts (rollout/fleet/deaths restarts from 0 in each
trainer process) from a real journal."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from verlj.journal import Journal

ROOT = Path(__file__).resolve().parents[2]


def _faults():
    spec = importlib.util.spec_from_file_location("faults", ROOT / "tools" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_an_unknown_kind_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "tools/faults.py", "--kinds", "fleet,nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "unknown kind(s) nope in --kinds" in out.stderr


def test_a_python_that_is_not_an_executable_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "tools/faults.py", "--python", str(tmp_path / "python")], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and not list(tmp_path.iterdir())
    assert out.stderr.strip() == f"error: --python {tmp_path / 'python'} is not an executable file"


def test_fleet_deaths_sums_each_trainer_process_count(tmp_path):
    # process 1: steps 1-3 (an actor died before step 2); process 2, resumed at step 4, counts from 0: two deaths by step 5
    deaths = {1: 0, 2: 1, 3: 1, 4: 1, 5: 2}
    with Journal.open_writer(tmp_path / "run" / "journal") as j:
        for step, d in deaths.items():
            control = [{"type": "control", "v": 1, "kind": "start" if step == 1 else "resume", "details": {}}] if step in (1, 4) else []
            j.writer.append_step(step, [*control, {"type": "metrics", "v": 1, "values": {"rollout/fleet/deaths": float(d)}}])
    assert _faults().fleet_deaths(tmp_path / "run") == 3
