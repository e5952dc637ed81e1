"""journal.local_dir when things go wrong at the worst moment: no run becomes unrecoverable, one writer.

- A failpoint matrix over publish / index / ship / rotate / prune / archive, segments compacted all
  along (kills inside a compaction: tests/unit/test_compaction.py): shipping is slowed (a
  slow shared filesystem), the trainer is killed at the point, the node's local journal is lost, and
  a resume elsewhere must be exact, with no more steps lost than the lag bound allows.
- Two trainers on one shipped run from two local directories: the second is refused before it
  touches anything, the first ends as if alone.
- A two-node launch (two torchrun agents, rendezvous on localhost, a local directory each): the node
  of rank 0 dies whole with its local directory; the job resumes on two new nodes, then on one.

Real `verlj train` processes, real SIGKILLs, the local journal really deleted.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.engine.state.manifest import check_snapshot
from verlj.journal import Journal, open_journal_reader, segments
from verlj_testing import TINY, assert_same_journal, cli, comparable_steps, env, fingerprints, free_port, popen, train, wait_forked_ended

LAG = 2
MATRIX = ["trainer.total_steps=6", "trainer.save_interval=2", "trainer.save_total_limit=1", f"journal.ship_max_lag_steps={LAG}"]
RETAIN = ["journal.retain_samples=since_oldest_snapshot", "journal.archive=true"]
SLOW_SHIPPING = "ship.before_publish:1:sleep-each=0.3"  # every shipment waits: the shipper trails the commits


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs with the LMDB journal in the run directory, with and without retention (made on first use)."""
    root, made = tmp_path_factory.mktemp("nodeloss"), {}

    def get(retain: bool):
        if retain not in made:
            made[retain] = root / f"ref-{retain}"
            # in this process (no interpreter to start); every snapshot written, as `verlj train` exits 0
            assert run_train(made[retain], None, [*TINY, *MATRIX, *(RETAIN if retain else [])]).snapshots_failed is None
        return made[retain]

    return get


def committed(local: Path) -> int:
    try:
        with Journal.open_reader(local) as j:
            return j.last_step()
    except Exception:  # noqa: BLE001 - not created yet
        return 0


@pytest.mark.parametrize("retain, points", [
    (True, f"{SLOW_SHIPPING},snapshot.before_rename:2"),  # step 4's snapshot written, not yet published
    (True, f"{SLOW_SHIPPING},snapshot.before_index:2"),  # published, not indexed
    (True, f"{SLOW_SHIPPING},snapshot.rotate:1"),  # step_00002 unindexed here, not yet in the segments
    (True, f"{SLOW_SHIPPING},snapshot.before_delete:1"),  # its unindexing shipped, the directory not yet deleted
    (False, f"{SLOW_SHIPPING},snapshot.rotated:1"),  # step_00002 deleted (no retention to wait for shipping after)
    (True, f"{SLOW_SHIPPING},journal.prune:2"),  # inside the transaction that prunes steps 3-4
    (True, f"{SLOW_SHIPPING},archive.mid_write:3"),  # writing steps 3-4 to the rollout archive
    (True, "ship.before_publish:5"),  # a shipment written, not published
])
def test_node_lost_at_each_crash_point_resumes_exactly(tmp_path, references, retain, points):
    reference = references(retain)
    over = [*MATRIX, *(RETAIN if retain else [])]
    run, local = tmp_path / "run", tmp_path / "L"
    over.append("journal.segment_fanout=2")  # shipped segments are compacted as they come (the default merges 64)
    out = train(run, *over, f"journal.local_dir={local}", VERLJ_FAILPOINT=points)
    assert out.returncode == -9, out.stderr[-3000:]
    done, shipped = committed(local), segments.scan(run / "journal").last_step or 0
    assert done - shipped <= LAG + 1  # the loss bound
    valid = [p.name for p in sorted(run.glob("step_*")) if check_snapshot(p).valid]
    shutil.rmtree(local)  # the node is gone
    with open_journal_reader(run / "journal") as j:  # what a recovery reads now: the segments alone
        named = [info["path"] for info in j.meta.snapshots().values()]
    assert all((run / name).is_dir() for name in named), (named, valid)  # nothing it names was deleted
    out = train(run, *over, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # every snapshot of a step before the one being committed was published (every 2 steps); the newest
    # whose step was shipped, or a newer one, is where the resume must start: none may be lost to rotation
    floor = max((s for s in range(2, done, 2) if s <= shipped), default=0)
    start = re.search(r"Resuming from checkpoint: .*step_(\d+)", out.stdout)
    assert (int(start.group(1)) if start else 0) >= floor, out.stdout[-3000:]
    for name in valid:  # a valid snapshot is used, adopted or set aside: never deleted by the resume
        assert name in out.stdout or (run / name).is_dir() or (run / "quarantine" / name).is_dir(), name
    assert_same_journal(reference, run)
    assert fingerprints(reference) == fingerprints(run)
    v = cli("verify", run)
    assert v.returncode == 0, v.stdout[-3000:]


def tree_digest(run: Path) -> str:
    """Everything of a run a second writer could damage (the claim, rewritten by its heartbeat, aside)."""
    h = hashlib.sha256()
    for p in sorted(run.rglob("*")):
        if p.is_file() and "writer" not in p.relative_to(run).parts:
            h.update(str(p.relative_to(run)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("first, resume", [("L1", True), ("L2", False)])
def test_a_second_trainer_on_a_live_shipped_run_is_refused(tmp_path, references, first, resume):
    reference = references(True)
    rng = random.Random(first)
    run = tmp_path / "run"
    second = "L2" if first == "L1" else "L1"
    stall = rng.randint(2, 4)  # hold the first trainer inside a step so the second surely meets it live
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *MATRIX, *RETAIN,
           f"journal.local_dir={tmp_path / first}"]
    live = popen(cmd, env=env(VERLJ_FAILPOINT=f"step.before_commit:{stall}:sleep=12"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while committed(tmp_path / first) < stall - 1 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.0))
    before = tree_digest(run)
    out = train(run, *MATRIX, *RETAIN, f"journal.local_dir={tmp_path / second}", resume=resume)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"is being written by pid {live.pid} on " in errors[0], out.stderr[-2000:]
    assert tree_digest(run) == before  # nothing of the live run was touched
    assert not (tmp_path / second / "data.mdb").exists()  # not even a rebuild of its own
    assert live.wait(timeout=180) == 0, live.communicate()[1][-3000:]
    assert_same_journal(reference, run)


# ----------------------------------------------------------------------------- two nodes


TWO_NODES = ["trainer.total_steps=6", "trainer.save_interval=2", "trainer.save_total_limit=2", "distributed.zero_stage=2",
             f"journal.ship_max_lag_steps={LAG}"]


def launch(run: Path, locals_: list[Path], *extra: str, **env_extra) -> list[subprocess.Popen]:
    """One torchrun agent per node (`len(locals_)` nodes, one rank each), rendezvous on localhost, each leading a
    session of its own (popen: the agents and their ranks forked by the fork server)."""
    port, n = free_port(), len(locals_)
    procs = []
    for rank, local in enumerate(locals_):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc_per_node", "1",
               "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *TWO_NODES, f"journal.local_dir={local}", *extra]
        procs.append(popen(cmd, env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    return [(p.wait(timeout=300), *p.communicate()) for p in procs]


def test_two_nodes_lose_the_node_of_rank_0_and_go_on(tmp_path):
    ref = tmp_path / "ref"
    outs = finish(launch(ref, [tmp_path / "r0", tmp_path / "r1"]))
    assert [o[0] for o in outs] == [0, 0], outs[0][2][-3000:]

    run = tmp_path / "run"
    node0, node1 = launch(run, [tmp_path / "a0", tmp_path / "a1"], VERLJ_FAILPOINT="step.before_commit:4:sleep=30")
    deadline = time.time() + 120
    while committed(tmp_path / "a0") < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert committed(tmp_path / "a0") == 3
    kill_node(node0)  # rank 0's node dies whole: agent and worker
    kill_node(node1)  # the scheduler ends the job's other node
    wait_forked_ended()  # the ranks, forked by the fork server, end as their forkclients (the agents' children) did
    shutil.rmtree(tmp_path / "a0")  # rank 0's local disk is lost with its node

    # the job is requeued on two new nodes: both local directories new
    outs = finish(launch(run, [tmp_path / "b0", tmp_path / "b1"], "--resume"))
    assert [o[0] for o in outs] == [0, 0], outs[0][2][-3000:]
    assert "Rebuilt the journal in" in outs[0][1]
    assert_same_journal(ref, run)
    assert fingerprints(ref) == fingerprints(run)

    # the same run goes on on one node alone: the topology rule (resharded, checked within tolerance)
    out = train(run, *TWO_NODES, "trainer.total_steps=8", f"journal.local_dir={tmp_path / 'c0'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "topology 2 ranks, ZeRO-2, TP 1 -> 1 rank, ZeRO-2, TP 1" in out.stdout
    steps = comparable_steps(run)
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert cli("verify", run).returncode == 0


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [p.pid], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
