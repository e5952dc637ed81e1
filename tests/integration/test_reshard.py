"""Resuming on another topology (world size, ZeRO stage, TP size): real ranks, real kills.

Each case kills a run with SIGKILL inside the commit of step 4 (a failpoint), resumes it on another
topology to step 8, and compares it with the uninterrupted run on the original topology:
- the prompts drawn and the samples generated are the same, every step;
- every journaled metric agrees within recovery.TOLERANCE (steps 3-8: the replayed one and five
  live ones);
- the actor's weights at step 8 (exported) agree within WEIGHT_TOL;
- the journal records the boundary, `verify` passes, and later replays on the new topology are
  exact again.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from verlj.engine.loop.recovery import TOLERANCE
from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem import rerun as rr
from verlj.journal import VerljError, open_journal_reader
from verlj_testing import TINY, cli, fingerprints, replay_here, train, verlj

BASE = ["trainer.total_steps=8", "trainer.save_interval=2", "trainer.save_total_limit=0"]
KILL = {"VERLJ_FAILPOINT": "journal.before_commit:4"}
WEIGHT_TOL = 1e-5  # absolute, on weights of magnitude ~0.1-1 after 8 AdamW steps at lr 1e-3


def steps(run):
    with open_journal_reader(run / "journal") as j:
        return list(j.iter_steps())


def assert_same_process(run, ref):
    """Same prompts and samples every step; metrics within the tolerance; returns the largest deviation."""
    got, want = steps(run), steps(ref)
    assert [r.step for r in got] == [r.step for r in want] == list(range(1, 9))
    worst = 0.0
    for a, b in zip(got, want):
        assert np.array_equal(a.first("data")["indices"], b.first("data")["indices"]), a.step
        sa, sb = a.first("buffer.add")["samples"], b.first("buffer.add")["samples"]
        for key in ("index", "prompt_ids", "response_ids", "score"):
            assert np.array_equal(sa[key], sb[key]), (a.step, key)
        ma, mb = a.metrics, b.metrics
        keys = [k for k in mb if not k.startswith("timing_s/")]
        assert keys and set(keys) <= set(ma)
        for k in keys:
            dev = abs(ma[k] - mb[k])
            assert dev <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(mb[k]), (a.step, k, ma[k], mb[k])
            worst = max(worst, dev)
    return worst


def exported(run, tmp_path, name, ranks=1, step=8):
    """`verlj replay RUN --to-step STEP --export DIR`: its weights and what it says of the topology.
    On one rank by the calls the command makes, in this process; on more, the command under torchrun."""
    out = tmp_path / name
    if ranks == 1:
        said = replay_here(run, step, export=out)[1]
    else:
        r = verlj("replay", run, "--to-step", step, "--export", out, ranks=ranks)
        assert r.returncode == 0, r.stderr[-3000:]
        said = r.stdout
    return load_file(str(out / "model.safetensors")), said


def assert_close_weights(a, b):
    assert sorted(a) == sorted(b)
    diff = max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)
    assert diff <= WEIGHT_TOL, diff
    return diff


def boundary(run):
    rec = steps(run)[3]
    assert rec.step == 4
    topo = [e for e in rec.all("control") if e["kind"] == "topology"]
    assert len(topo) == 1
    return topo[0]["details"]


def killed_then_resumed(run, over, new_over, ranks, new_ranks):
    r = train(run, *BASE, *over, ranks=ranks, **KILL)
    assert r.returncode != 0
    assert max(fingerprints(run)) == 3
    r = train(run, *BASE, *over, *new_over, ranks=new_ranks, resume=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    out = {}
    for name, over, ranks in (("z2x2", ["distributed.zero_stage=2"], 2), ("z0x1", [], 1),
                              ("ppo_z1", ["algorithm.name=ppo", "distributed.zero_stage=1"], 1),
                              ("tp2", ["distributed.tensor_parallel_size=2"], 2)):
        if ranks == 1:  # an uninterrupted one-rank run: in this process, no interpreter of its own to start
            assert run_train(root / name, None, [*TINY, *BASE, *over]).snapshots_failed is None  # as `verlj train` exits 0
        else:
            r = train(root / name, *BASE, *over, ranks=ranks)
            assert r.returncode == 0, r.stderr[-4000:]
        out[name] = root / name
    return out


def test_two_ranks_zero2_killed_resumed_on_one_rank(tmp_path, refs):
    run = tmp_path / "run"
    r = killed_then_resumed(run, ["distributed.zero_stage=2"], [], 2, 1)
    assert "Resharded step_00002 from 2 ranks, ZeRO-2, TP 1 to 1 rank, ZeRO-2, TP 1" in r.stdout
    assert "MPU is not provided" not in r.stdout + r.stderr  # DeepSpeed's warning on every reshard, silenced
    assert "Step 4: topology 2 ranks, ZeRO-2, TP 1 -> 1 rank, ZeRO-2, TP 1" in r.stdout
    assert_same_process(run, refs["z2x2"])
    b = boundary(run)
    assert b["from"] == {"world_size": 2, "tensor_parallel_size": 1, "zero_stage": 2}
    assert b["to"] == {"world_size": 1, "tensor_parallel_size": 1, "zero_stage": 2}
    assert b["replayed"] == [3, 3] and b["checked_steps"] == 1 and b["rebased"]["step"] == 3
    # the converted form is cached beside the snapshot, with its own manifest, and verify accepts the run
    assert (run / "step_00002" / "universal" / "manifest.json").is_file()
    v = cli("verify", run, "--deep")
    assert v.returncode == 0, v.stdout + v.stderr
    assert "other topology" in v.stdout  # the deep replay from step_00002 crossed the boundary
    said = cli("inspect", run).stdout
    assert "topology   from step 4: 2 ranks, ZeRO-2, TP 1 -> 1 rank, ZeRO-2, TP 1; 1 replayed step(s)" in said
    assert "ranks      1 (started on 2)" in said and "\nrollout    hf " in said  # what runs it now, and with what
    said = cli("diff", run, refs["z2x2"]).stdout
    assert said.startswith("first difference at step 4") and f"note: {run} changed topology from step 4" in said
    mine, _ = exported(run, tmp_path, "mine")
    theirs, said = exported(refs["z2x2"], tmp_path, "theirs")  # a 2-rank snapshot, loaded in one process
    assert_close_weights(mine, theirs)
    # on the new topology, replay from its own snapshots is exact again; from step_00002 it rejoins
    # the reference line at the boundary (the rebased fingerprint), so step 5 matches bit for bit
    got = replay_here(run, 5)[0]
    want = fingerprints(run)
    assert got["fingerprint"] == want[5] and got["exact"] and got["from_snapshot"] == 4
    # a replay that must start from the old topology's snapshot (the newer ones are damaged) crosses the
    # boundary again and is exact from there: the conversion is cached, the replay deterministic
    for name in ("step_00004", "step_00006", "step_00008"):
        (run / name / "meta.json").write_text("{}")
    got = replay_here(run, 6)[0]
    assert got["from_snapshot"] == 2 and got["fingerprint"] == want[6] and got["exact"]


def test_one_rank_resumed_on_two_ranks(tmp_path, refs):
    run = tmp_path / "run"
    r = killed_then_resumed(run, [], [], 1, 2)
    assert "Resharded step_00002 from 1 rank, ZeRO-0, TP 1 to 2 ranks, ZeRO-0, TP 1" in r.stdout
    assert_same_process(run, refs["z0x1"])
    assert_close_weights(exported(run, tmp_path, "mine")[0], exported(refs["z0x1"], tmp_path, "theirs")[0])


def test_zero1_resumed_as_zero3_with_a_critic(tmp_path, refs):
    run = tmp_path / "run"
    r = killed_then_resumed(run, ["algorithm.name=ppo", "distributed.zero_stage=1"], ["distributed.zero_stage=3"], 1, 1)
    assert "to 1 rank, ZeRO-3, TP 1" in r.stdout
    assert_same_process(run, refs["ppo_z1"])
    assert boundary(run)["to"]["zero_stage"] == 3
    assert_close_weights(exported(run, tmp_path, "mine")[0], exported(refs["ppo_z1"], tmp_path, "theirs")[0])


def test_tensor_parallel_resumed_on_one_rank_and_exported(tmp_path, refs):
    run = tmp_path / "run"
    r = killed_then_resumed(run, ["distributed.tensor_parallel_size=2"], ["distributed.tensor_parallel_size=1"], 2, 1)
    assert "from 2 ranks, ZeRO-0, TP 2 to 1 rank, ZeRO-0, TP 1" in r.stdout
    assert_same_process(run, refs["tp2"])
    mine = exported(run, tmp_path, "mine")[0]
    # --export of the TP run: on its own 2 ranks (shards joined) and in one process (resharded)
    on_two = exported(refs["tp2"], tmp_path, "two", ranks=2)[0]
    on_one = exported(refs["tp2"], tmp_path, "one")[0]
    assert all(np.array_equal(on_two[k], on_one[k]) for k in on_two)  # the same weights, joined two ways
    assert_close_weights(mine, on_two)


def test_replay_of_a_two_rank_run_in_one_process_and_the_reverse(tmp_path, refs):
    # 2-rank run replayed in one process from step_00002 (resharded) vs on its own 2 ranks (exact)
    one, said = exported(refs["z2x2"], tmp_path, "one", step=3)
    assert "other topology" in said
    two, said2 = exported(refs["z2x2"], tmp_path, "two", ranks=2, step=3)
    assert "other topology" not in said2
    assert_close_weights(one, two)
    # digests compared bit for bit need the run's own topology: rerun in one process says so in one line
    # (the call `verlj rerun RUN --steps 3:3` makes, in this process: the command prints "error: " + the
    # sentence as its only line and exits with its exit_code)
    with pytest.raises(VerljError) as refused:
        rr.rerun(refs["z2x2"], 3, 3, False)
    assert refused.value.exit_code == 1 and [f"error: {refused.value}"] == [
        "error: step 3 ran on 2 rank(s) with TP 1, this is 1 with TP 1: its digests are compared on as many ranks "
        "(torchrun --nproc_per_node 2 -m verlj.cli ...)"]
    # and a 1-rank run replayed on 2 ranks
    one, _ = exported(refs["z0x1"], tmp_path, "one1", step=3)
    two, said = exported(refs["z0x1"], tmp_path, "two1", ranks=2, step=3)
    assert "other topology" in said
    assert_close_weights(one, two)


def test_a_tp_run_with_zero_is_refused_in_one_sentence(tmp_path):
    run = tmp_path / "run"
    r = train(run, "trainer.total_steps=3", "trainer.save_interval=2", "distributed.tensor_parallel_size=2",
              "distributed.zero_stage=1", ranks=2, **{"VERLJ_FAILPOINT": "journal.before_commit:3"})
    assert r.returncode != 0
    r = train(run, "trainer.total_steps=3", "trainer.save_interval=2", "distributed.tensor_parallel_size=1",
              "distributed.zero_stage=1", resume=True)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert "cannot be resharded" in line and "Traceback" not in r.stderr
