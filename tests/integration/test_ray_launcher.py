"""`verlj train --launcher ray --nproc 2`: the trainer's ranks as Ray actors in a placement group, on a real
local Ray cluster (the `cluster` fixture, conftest.py), trained to the same journal as torchrun's two ranks;
through a real SIGKILL of one rank actor's process with trainer.max_restarts=2 the run ends by itself,
bit-identical. Without ray, --launcher ray is one line, exit 2 (and --nproc without it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verlj_testing import REPO, TINY, assert_same_journal, committed, env, fingerprints, train, verlj

RAY = ["--launcher", "ray", "--nproc", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run on two ranks under torchrun."""
    run = tmp_path_factory.mktemp("ray_launcher") / "reference"
    out = train(run, ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_two_ranks_as_ray_actors_train_as_torchrun_does(tmp_path, cluster, reference):
    run = tmp_path / "run"
    out = train(run, *RAY, **cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = re.search(r"verlj: training on 2 ranks \(rank 0 in process (\d+) on \S+, rank 1 in process (\d+) on \S+\)", out.stderr)
    assert pids and pids.group(1) != pids.group(2), out.stderr[-3000:]
    assert fingerprints(run)[4] == fingerprints(reference)[4]
    assert_same_journal(run, reference)


def test_a_rank_actor_killed_by_sigkill_restarts_the_ranks_and_the_run_ends_identical(tmp_path, cluster, reference):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *RAY, "trainer.max_restarts=2"]
    # step 3 waits a minute before its commit in the first attempt (its processes' 3rd commit; the restarted ones
    # commit steps 3 and 4 only): once step 2 is in the journal, both ranks are alive for a minute. The journal,
    # not rank 0's forwarded line, says when: under a loaded CI the launcher showed "Step 2" only after the ranks ended
    slow = {"VERLJ_FAILPOINT": "step.before_commit:3:sleep=60"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(**cluster, **slow), cwd=REPO)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: [seen.append(line) for line in p.stdout], daemon=True)
    reader.start()
    started = r"verlj: training on 2 ranks \(rank 0 in process (\d+) on \S+, rank 1 in process (\d+)"
    deadline = time.monotonic() + 300
    while committed(run) < 2 or not re.search(started, "".join(seen)):
        assert p.poll() is None and time.monotonic() < deadline, "".join(seen)[-3000:]
        time.sleep(0.1)
    ranks = tuple(int(pid) for pid in re.search(started, "".join(seen)).groups())
    os.kill(ranks[1], signal.SIGKILL)  # rank 1 waits on rank 0's sleep: kill -9 its actor
    p.wait(timeout=600)
    reader.join(timeout=30)
    out = "".join(seen)
    assert p.returncode == 0, out[-3000:]
    assert re.search(rf"verlj: rank 1's actor \(process {ranks[1]} on \S+\) died; restarting the ranks with --resume \(1 of 2\)", out), out[-3000:]
    again = re.search(r"verlj: training on 2 ranks \(rank 0 in process (\d+) on \S+, rank 1 in process (\d+) on \S+; restart 1 of 2\)", out)
    assert again and not {int(again.group(1)), int(again.group(2))} & set(ranks), out[-3000:]
    deadline = time.monotonic() + 10
    while Path(f"/proc/{ranks[0]}").exists() and time.monotonic() < deadline:  # the other rank's actor was killed too
        time.sleep(0.1)
    assert not Path(f"/proc/{ranks[0]}").exists()
    assert "restart 2 of 2" not in out
    assert fingerprints(run) == fingerprints(reference)
    assert_same_journal(run, reference)


def test_without_ray_the_ray_launcher_is_one_line_and_exit_2(tmp_path):
    """ray hidden from the CLI's process (None in sys.modules: `import ray` raises ImportError there)."""
    run = tmp_path / "run"
    code = ("import sys; sys.modules['ray'] = None; from verlj.cli.main import main; "
            f"sys.argv = ['verlj', 'train', '--output-dir', {str(run)!r}, *{[*TINY, *RAY]!r}]; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--launcher ray needs ray: pip install 'verlj[ray]'" in lines[0], out.stderr
    assert not run.exists()
    out = verlj("train", "--output-dir", run, "--nproc", "2")  # ranks are torchrun's or the Ray launcher's to start
    assert out.returncode == 2 and out.stderr.strip() == "error: --nproc is the number of ranks --launcher ray starts (under torchrun: --nproc_per_node)"
    assert not run.exists()


def test_a_fleet_on_two_ray_ranks_is_refused_before_any_is_placed(tmp_path):
    """rollout.fleet=ray runs with one trainer rank: `--launcher ray --nproc 2` says so in one line, exit 2,
    before it starts or joins a cluster (no RAY_ADDRESS here: a local one would be started) or writes the run."""
    run = tmp_path / "run"
    out = verlj("train", "--output-dir", run, *RAY, *TINY, "rollout.mode=async", "rollout.fleet=ray")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == ("error: rollout.fleet=ray runs with one trainer rank in this version, and this job has 2: train on one "
                                  "(--launcher ray --nproc 1, or no torchrun) or set rollout.fleet=none"), out.stderr
    assert not run.exists()
