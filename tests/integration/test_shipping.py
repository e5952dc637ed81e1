"""journal.local_dir: the node that held the LMDB journal dies; the run goes on from the run directory.

Real `verlj train` processes, real SIGKILLs, the local journal really deleted. Every scenario ends
with the journal equal, step for step, to an uninterrupted run's (which keeps today's layout).
"""

import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.journal import Journal, segments
from verlj_testing import TINY, _same, assert_same_journal, cli, comparable_steps, env, fingerprints, popen, replay_here, train, verlj

TARGET = 10
COMMON = [f"trainer.total_steps={TARGET}", "trainer.save_interval=3", "trainer.save_total_limit=2"]
LAG = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    run_train(run, None, [*TINY, *COMMON])
    return run


def shipped_run(tmp_path, name="run", *extra):
    """A finished run with journal.local_dir, and its local dir."""
    run, local = tmp_path / name, tmp_path / f"{name}-local"
    train(run, *COMMON, f"journal.local_dir={local}", f"journal.ship_max_lag_steps={LAG}", *extra)
    return run, local


def lose_node(local):
    shutil.rmtree(local)


@pytest.fixture(scope="module")
def node_lost(tmp_path_factory):
    """shipped_run's run directory after its node was lost (the local dir deleted), made once per module:
    what another machine holds. The tests that start there take a copy of their own (lost_node_copy)."""
    run, local = shipped_run(tmp_path_factory.mktemp("shipped"))
    with Journal.open_reader(local) as j:
        assert j.last_step() == TARGET  # it finished
    lose_node(local)
    return run


def lost_node_copy(node_lost, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(node_lost, run, symlinks=True)
    return run


def test_node_lost_at_a_random_moment(tmp_path, reference):
    run, local = tmp_path / "run", tmp_path / "L"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *COMMON,
           f"journal.local_dir={local}", f"journal.ship_max_lag_steps={LAG}"]
    proc = popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rng = random.Random()
    target = rng.randint(2, TARGET - 2)
    deadline = time.time() + 120
    while time.time() < deadline and _committed(local) < target:  # a random step, then a random moment in it
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signal.SIGKILL)
    stdout, _ = proc.communicate()
    with Journal.open_reader(local) as j:
        committed = j.last_step()
    reported = [int(s) for s in re.findall(r"\[INFO\] Step (\d+): reward=", stdout)]  # commits that returned
    shipped = segments.scan(run / "journal").last_step or 0
    # the bound: every step whose commit returned is shipped but the last LAG; the step in flight may be lost too
    assert shipped >= (max(reported) if reported else 0) - LAG
    assert shipped >= committed - LAG - 1
    lose_node(local)

    out = train(run, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    if shipped > 0:
        assert f"steps through {shipped}" in out.stdout  # rebuilt from the segments, said in one line
    print(f"committed {committed}, shipped {shipped}: {committed - shipped} step(s) lost with the node and run again")
    assert_same_journal(reference, run)
    assert fingerprints(reference) == fingerprints(run)
    assert cli("verify", run).returncode == 0


def test_stalled_shipping_holds_training_to_the_lag_bound(tmp_path, reference):
    """Shipping stops (a hung filesystem); training goes on LAG steps, then waits. The node dies then."""
    run, local = tmp_path / "run", tmp_path / "L"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *COMMON,
           f"journal.local_dir={local}", f"journal.ship_max_lag_steps={LAG}"]
    proc = popen(cmd, env=env(VERLJ_FAILPOINT="ship.before_publish:4:sleep=120"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while _committed(local) < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    last, since = -1, time.time()
    while time.time() - since < 2.0:  # until the journal stops growing: training is waiting for the shipper
        now = _committed(local)
        if now != last:
            last, since = now, time.time()
        time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGKILL)
    stdout, _stderr = proc.communicate()
    shipped = segments.scan(run / "journal").last_step or 0
    reported = max(int(s) for s in re.findall(r"\[INFO\] Step (\d+): reward=", stdout))
    assert last < TARGET
    assert reported == shipped + LAG  # the last step whose commit returned: LAG beyond what was shipped
    assert last == shipped + LAG + 1  # and the one committed locally while waiting
    lose_node(local)
    out = train(run, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(reference, run)
    assert fingerprints(reference) == fingerprints(run)


def _committed(local) -> int:
    try:
        with Journal.open_reader(local) as j:
            return j.last_step()
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def test_kill_during_shipping_then_the_same_node_resumes(tmp_path, reference):
    run, local = tmp_path / "run", tmp_path / "L"
    out = train(run, *COMMON, f"journal.local_dir={local}", "journal.ship_max_lag_steps=0",
                VERLJ_FAILPOINT="ship.before_publish:7")
    assert out.returncode == -9
    assert segments.scan(run / "journal").leftovers  # the unpublished shipment is there, never read
    out = train(run, *COMMON, f"journal.local_dir={local}", "journal.ship_max_lag_steps=0", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = segments.scan(run / "journal")
    assert found.problem is None and not found.leftovers and found.last_step == TARGET
    assert_same_journal(reference, run)
    lose_node(local)  # and what was shipped is the whole journal
    assert_same_journal(reference, run)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_last_segment_costs_only_its_steps(tmp_path, reference, node_lost, damage):
    run = lost_node_copy(node_lost, tmp_path)  # the node is lost; the damaged segment is found on the resume elsewhere
    files = sorted(segments.segment_dir(run / "journal").glob("*.seg"))
    while segments.read_segment(files[-1]).first is None:  # shipments after the last step never happened
        files.pop().unlink()
    last = segments.read_segment(files[-1])
    raw = bytearray(files[-1].read_bytes())
    if damage == "truncate":
        files[-1].write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        raw[-9] ^= 0x04
        files[-1].write_bytes(bytes(raw))
    lost = f"step {last.first}" if last.first == last.last else f"steps {last.first}–{last.last}"
    was = f"step {last.first} was" if last.first == last.last else f"steps {last.first}–{last.last} were"
    v = cli("verify", run)  # the same answer as the resume below: not damage that stops it
    assert v.returncode == 0 and "⚠ journal segments:" in v.stdout and f"sets it aside and runs {lost} again" in v.stdout, v.stdout
    assert "Resume is not possible" not in v.stdout and "Resume is possible from" in v.stdout
    out = train(run, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{was} lost with it and will be run again" in out.stdout
    assert_same_journal(reference, run)
    assert fingerprints(reference) == fingerprints(run)
    v = cli("verify", run)
    assert v.returncode == 0 and "journal/segments/.damaged-" in v.stdout, v.stdout


def test_segment_missing_in_the_middle_is_refused(tmp_path, node_lost):
    run = lost_node_copy(node_lost, tmp_path)
    seg_dir = segments.segment_dir(run / "journal")
    (seg_dir / "0000000004.seg").unlink()
    before = sorted(p.name for p in seg_dir.iterdir())
    out = train(run, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "0000000004.seg is missing" in err[0] and "Traceback" not in out.stderr, out.stderr
    assert sorted(p.name for p in seg_dir.iterdir()) == before  # nothing shipped, nothing removed
    assert not (tmp_path / "L2" / "data.mdb").exists()
    v = cli("verify", run)
    assert v.returncode == 1 and "0000000004.seg is missing" in v.stdout
    assert "--fork NEW_RUN" in v.stdout  # the way forward: replay the intact prefix into a new run


def test_post_mortem_from_the_run_directory_alone(tmp_path, reference, node_lost):
    run = lost_node_copy(node_lost, tmp_path)  # another machine: only the run directory
    v = cli("verify", run)
    assert v.returncode == 0 and "Journal segments:" in v.stdout and f"steps through {TARGET}" in v.stdout, v.stdout
    assert cli("journal", "verify", run / "journal").returncode == 0
    assert cli("diff", reference, run).returncode == 0
    i = cli("inspect", run, "--step", "5", check=True)
    assert "step 5" in i.stdout
    m = cli("metrics", run, "--names", "actor/pg_loss", "--csv", check=True)
    assert len(m.stdout.strip().splitlines()) == TARGET + 1
    # measured after each commit, the shipping lag is in the logs only: read from metrics.jsonl
    m = cli("metrics", run, "--names", "journal/ship_lag_steps,actor/pg_loss", "--csv", check=True)
    rows = [line.split(",") for line in m.stdout.strip().splitlines()]
    assert rows[0] == ["step", "journal/ship_lag_steps", "actor/pg_loss"] and all(r[1].strip() for r in rows[1:]), m.stdout
    bad = cli("metrics", run, "--names", "actor/pg_los")
    assert bad.returncode == 2 and "…" not in bad.stderr and "timing_s/step" in bad.stderr  # every name, none cut
    assert cli("find", run, "--where", "actor/pg_loss is nan").returncode == 0
    assert replay_here(run, 7)[0]["fingerprint"] == fingerprints(reference)[7]


def test_a_shipped_run_killed_before_its_first_step_does_not_block_a_retry(tmp_path):
    run, local = tmp_path / "r", tmp_path / "L"
    out = train(run, f"journal.local_dir={local}", VERLJ_FAILPOINT="step.before_commit:1")
    assert out.returncode == -9
    out = train(run, "trainer.total_steps=2", f"journal.local_dir={local}", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "never committed a step; starting it afresh" in out.stdout
    assert sorted(fingerprints(run)) == [1, 2]
    # another run may not take over this local directory while it holds this run's journal
    out = train(tmp_path / "other", f"journal.local_dir={local}")
    assert out.returncode != 0 and "does not match" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "other").exists()


def test_a_local_dir_inside_the_run_directory_is_refused(tmp_path):
    run = tmp_path / "r"
    for local in (run, run / "local"):
        out = train(run, f"journal.local_dir={local}")
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-2000:]
        assert f"journal.local_dir {local} is inside the run directory {run}" in out.stderr
        assert not run.exists()


def test_a_resume_on_the_same_host_with_a_new_local_dir_keeps_the_unshipped_steps(tmp_path, reference):
    """The previous local journal is still on this host, ahead of the segments: its steps are copied,
    not run again."""
    run, old, new = tmp_path / "run", tmp_path / "L", tmp_path / "L2"
    out = train(run, *COMMON, f"journal.local_dir={old}", "journal.ship_max_lag_steps=4",
                VERLJ_FAILPOINT="ship.before_publish:1:sleep-each=5,step.before_commit:7")  # shipping slower than any step, even on a loaded machine
    assert out.returncode == -9, out.stderr[-3000:]
    held, shipped = _committed(old), segments.scan(run / "journal").last_step or 0
    assert held == 6 and shipped < held
    out = train(run, *COMMON, f"journal.local_dir={new}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Copied the journal from the previous local directory {old} (steps through 6, {6 - shipped} not shipped)" in out.stdout
    trained = [int(s) for s in re.findall(r"\[INFO\] Step (\d+): reward=", out.stdout)]
    assert trained == list(range(7, TARGET + 1)), out.stdout  # steps 1-6 were not run again
    assert_same_journal(reference, run)


def _tree(root) -> dict[str, bytes]:
    """A directory's files but its locks (LMDB's, and the writers' claims, which every writer that starts adds to)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("lock.mdb", "writer.lock") and p.relative_to(root).parts[0] != "writer"}


def test_a_copy_never_writes_into_the_original_s_local_journal(tmp_path, reference):
    """cp -a of a journal.local_dir run carries local.json along: the copy's --resume is refused in one
    line (the original's local journal and run directory untouched, its own resume exact), and with a
    journal.local_dir of its own the copy goes on from its segments, exactly."""
    run, local, copy = tmp_path / "run", tmp_path / "L", tmp_path / "copy"
    out = train(run, *COMMON, "trainer.total_steps=6", f"journal.local_dir={local}")
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.copytree(run, copy, symlinks=True)
    before, held = _tree(run), _tree(local)
    out = train(copy, *COMMON, resume=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{copy} is a copy of the run in {run}" in errors[0], out.stderr[-3000:]
    assert f"(through step 6) with a journal of its own, rebuilt from its segments: `verlj train -o {copy} --resume journal.local_dir=NEW_EMPTY_DIR`" in errors[0]
    assert f"`verlj replay {copy} --to-step 6 --fork NEW_RUN journal.local_dir=NEW_LOCAL_DIR`" in errors[0]
    assert _tree(run) == before and _tree(local) == held and _committed(local) == 6
    out = train(run, *COMMON, f"journal.local_dir={local}", resume=True)  # the original goes on as itself
    assert out.returncode == 0 and "Rebuilt" not in out.stdout, out.stderr[-3000:]
    assert_same_journal(reference, run)
    assert fingerprints(reference) == fingerprints(run) and cli("verify", run).returncode == 0
    # the copy's readers do not take the original's local journal (now through step 10) for its own
    assert "6 committed, last step 6" in cli("inspect", copy, check=True).stdout
    assert cli("verify", copy).returncode == 0
    forked = tmp_path / "forked"  # the other way on: a new run from the copy's state, its journal shipped too
    verlj("replay", copy, "--to-step", 6, "--fork", forked, f"journal.local_dir={tmp_path / 'L3'}", check=True)
    assert cli("verify", forked).returncode == 0
    out = train(copy, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)  # a journal of its own
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Rebuilt the journal" in out.stdout and "Copied the journal" not in out.stdout, out.stdout
    assert_same_journal(reference, copy)
    assert fingerprints(reference) == fingerprints(copy) == fingerprints(run)


def test_a_moved_run_resumes_as_itself(tmp_path, reference):
    """mv of a journal.local_dir run: the local journal is still its own, with the steps not yet shipped."""
    run, local, moved = tmp_path / "run", tmp_path / "L", tmp_path / "moved"
    out = train(run, *COMMON, f"journal.local_dir={local}", "journal.ship_max_lag_steps=4",
                VERLJ_FAILPOINT="ship.before_publish:1:sleep-each=5,step.before_commit:7")  # shipping slower than any step, even on a loaded machine
    assert out.returncode == -9, out.stderr[-3000:]
    held, shipped = _committed(local), segments.scan(run / "journal").last_step or 0
    assert held == 6 and shipped < held
    run.rename(moved)
    out = train(moved, *COMMON, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    trained = [int(s) for s in re.findall(r"\[INFO\] Step (\d+): reward=", out.stdout)]
    assert trained == list(range(7, TARGET + 1)) and "Rebuilt" not in out.stdout, out.stdout  # steps 1-6 kept
    assert segments.read_pointer(moved / "journal")["path"] == str(local.resolve())
    assert_same_journal(reference, moved)
    assert fingerprints(reference) == fingerprints(moved)


def _same_steps(reference, run) -> None:
    """Every step of `run` (a fork of `reference`) as `reference` journaled it, but its control and
    config events and timings (verlj_testing.comparable_steps)."""
    want = {s["step"]: s for s in comparable_steps(reference)}
    for got in comparable_steps(run):
        assert _same(got, want[got["step"]]), f"step {got['step']} differs"


def test_a_fork_with_local_dir_verifies_and_resumes_exactly(tmp_path, reference):
    """replay --fork with journal.local_dir: the fork's segments verify (they were called damaged at
    its first step), and the fork, stopped at step 7 and its node lost, resumes from them alone to
    the uninterrupted run's steps."""
    fork, local = tmp_path / "fork", tmp_path / "L"
    verlj("replay", reference, "--to-step", 4, "--fork", fork, f"journal.local_dir={local}",
          f"journal.ship_max_lag_steps={LAG}", "trainer.total_steps=7", check=True)
    v = cli("verify", fork)
    assert v.returncode == 0 and "steps through 7" in v.stdout, v.stdout
    lose_node(local)
    out = train(fork, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Rebuilt the journal" in out.stdout, out.stdout
    assert fingerprints(fork) == {s: fp for s, fp in fingerprints(reference).items() if s > 4}
    _same_steps(reference, fork)
    assert cli("verify", fork).returncode == 0


def test_a_fork_at_the_parent_s_last_step_with_local_dir_ends_and_resumes_exactly(tmp_path, reference):
    """A fork at its parent's last step trains nothing: it ends at once (it waited 10 minutes for its
    shipper), verifies, and resumed from its segments alone goes on as the uninterrupted run did."""
    parent, fork, local = tmp_path / "parent", tmp_path / "fork", tmp_path / "L"
    assert run_train(parent, None, [*TINY, *COMMON, "trainer.total_steps=6"]).snapshots_failed is None  # in this process, as `verlj train` exits 0
    t0 = time.monotonic()
    out = verlj("replay", parent, "--to-step", 6, "--fork", fork, f"journal.local_dir={local}", timeout=240)
    assert out.returncode == 0 and time.monotonic() - t0 < 120, out.stderr[-3000:]
    assert "already at trainer.total_steps=6; nothing to train" in out.stderr + out.stdout
    v = cli("verify", fork)
    assert v.returncode == 0, v.stdout
    lose_node(local)
    out = train(fork, *COMMON, f"journal.local_dir={tmp_path / 'L2'}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(fork) == {s: fp for s, fp in fingerprints(reference).items() if s > 6}
    _same_steps(reference, fork)
    assert cli("verify", fork).returncode == 0
