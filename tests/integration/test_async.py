"""rollout.mode=async (deterministic step order): a real generator process beside the trainer, real
SIGKILLs of the trainer (at a random moment and at the failpoints of admit, push and consume)
and of the generator alone; every resumed run must equal the uninterrupted async run, step for step."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_recovery import kill_at_random

from verlj.engine.loop.run import train as run_train
from verlj.journal import VerljError, open_journal_reader
from verlj_testing import TINY, assert_same_journal, children, cli, committed, env, fingerprints, popen, train, verlj

# dynamic sampling over 2 rounds at most, so carried-over groups meet the staleness bound
ASYNC = ["rollout.mode=async", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2", "trainer.total_steps=6",
         "trainer.save_interval=3"]


def finish(run, over, **env_extra):
    out = train(run, *over, resume=True, **env_extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone(pids: list[int], within: float = 10.0) -> bool:
    """Whether every process in `pids` has exited (or is a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("async") / "ref"
    out = train(run, *ASYNC)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_the_journal_records_versions_plans_and_the_off_policy_metrics(reference):
    with open_journal_reader(reference / "journal") as j:
        records = {r.step: r for r in j.iter_steps()}
    first = records[1]
    plan = first.first("buffer.plan")
    assert plan["steps"].tolist() == [1, 2]  # step 1 generates its own batch and step 2's, both from version 0
    assert first.first("rollout")["mode"] == "async" and first.first("rollout")["max_staleness"] == 1
    for step, r in records.items():
        m = r.metrics
        assert m["rollout/staleness/max"] <= 1 and m["rollout/staleness/mean"] == (0.0 if step == 1 else 1.0), (step, m)
        assert 0 < m["rollout/is_weight/mean"] and m["rollout/is_weight/max"] > 0
        if step > 1:
            assert r.first("buffer.plan")["steps"].tolist() == [step + 1]
            assert set(r.first("buffer.add")["samples"]["policy_version"].tolist()) == {step - 1}
    # the step-1 samples come from the weights the trainer holds: the generator's log-probs are the
    # trainer's, up to the KV cache's rounding
    assert records[1].metrics["rollout/logprob_diff/max"] < 1e-5
    # the weights move: after step 1 the trainer's log-probs of stale samples are not the generator's
    assert any(r.metrics["rollout/is_weight/max"] != 1.0 for s, r in records.items() if s > 1)
    out = cli("inspect", reference, "--step", "3", check=True).stdout
    assert "async, max_staleness 1" in out and "planned    step 4 will train on" in out and "staleness mean 1 max 1" in out
    assert " v2   |" in out  # the samples generated at step 3 come from version 2
    path = reference.parent / "rollouts.jsonl"
    cli("export", reference, "--rollouts", "-o", path, check=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["step"], r["policy_version"]) for r in rows} == {(1, 0), *((s, s - 1) for s in range(2, 7))}


def test_a_dead_generator_and_kills_at_every_async_failpoint_then_resume_is_exact(tmp_path, reference):
    """One run, stopped four times: its generator killed alone, then the trainer SIGKILLed at each
    failpoint of the async path in turn (each resume replays and continues until the next; the
    commit's failpoint is test_recovery's, the generator's start the replay test's)."""
    run = tmp_path / "run"
    out = train(run, *ASYNC, VERLJ_FAILPOINT="generator.before_reply:5")  # SIGKILL of the generator process alone
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "the rollout generator process (pid " in lines[0] and "killed by signal 9" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    last = committed(run)
    assert last >= 1
    # each count is in hits after that resume: admit (a batch made durable), push (new weights),
    # consume (a step taking its plan)
    for point in ("async.admit:2", "async.push:1", "async.consume:2"):
        out = train(run, *ASYNC, resume=True, VERLJ_FAILPOINT=point)
        assert out.returncode == -9, (point, out.stderr[-3000:])
        now = committed(run)
        assert now >= last, point
        last = now
    assert last < 6
    finish(run, ASYNC)
    assert_same_journal(reference, run)


def test_random_kills_of_the_trainer_then_resume_is_exact(tmp_path, reference):
    """SIGKILL of the trainer process alone at a random moment: its generator dies with it."""
    rng = random.Random(22)
    run = tmp_path / "run"
    kids = kill_at_random(run, ASYNC, rng, group=False)
    assert kids, "no generator process beside the trainer"
    assert gone(kids), "the generator outlived the trainer"
    finish(run, ASYNC)
    assert_same_journal(reference, run)


def test_sigint_finishes_the_step_stops_the_generator_and_exits_0(tmp_path, reference):
    """And the result does not depend on which side is faster: the generator here is 0.3 s slower
    per batch (the trainer waits for it), and the run still ends bit-identical to the reference."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *ASYNC]
    p = popen(cmd, env=env(VERLJ_FAILPOINT="generator.before_reply:1:sleep-each=0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for line in p.stdout:
        if "[INFO] Step 2: reward=" in line:
            break
    kids = children(p.pid)
    os.killpg(p.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C: the generator ignores it
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert "Received SIGINT" in rest and "snapshot taken" in rest, rest
    assert kids and gone(kids)  # the generator (and multiprocessing's resource tracker) exit with the trainer
    last = max(fingerprints(run))
    assert (run / f"step_{last:05d}").is_dir()
    finish(run, ASYNC)
    assert_same_journal(reference, run)


def test_replay_never_starts_a_generator_and_a_fork_continues_exactly(tmp_path, reference):
    out = verlj("replay", reference, "--to-step", "5", VERLJ_FAILPOINT="async.start:1", check=True)
    assert fingerprints(reference)[5] in out.stdout
    fork = tmp_path / "fork"
    verlj("replay", reference, "--to-step", "4", "--fork", fork, check=True)
    want, got = fingerprints(reference), fingerprints(fork)
    assert {s: got[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}


def test_two_ranks_zero3_ppo_killed_and_resumed_match_the_uninterrupted_run(tmp_path):
    over = ["rollout.mode=async", "rollout.max_staleness=2", "algorithm.name=ppo", "distributed.zero_stage=3", "trainer.total_steps=4",
            "trainer.save_interval=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *over, ranks=2).returncode == 0
    out = train(run, *over, ranks=2, VERLJ_FAILPOINT="async.admit:3")
    assert out.returncode != 0
    out = train(run, *over, ranks=2, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(ref, run)
    with open_journal_reader(run / "journal") as j:
        assert j.read_step(4).metrics["rollout/staleness/max"] == 2.0


def test_tensor_parallel_ranks_generate_what_one_rank_does_and_resume_exactly(tmp_path):
    """TP=2: each rank's generator holds the whole policy (gathered from the TP shards at each push)
    and generates its data-parallel group's share, so step 1 (version 0) samples are a one-rank
    async run's; a SIGKILL at the first push, then --resume, ends bit-identical."""
    over = ["rollout.mode=async", "distributed.tensor_parallel_size=2", "trainer.total_steps=3", "trainer.save_interval=2"]
    one, ref, run = tmp_path / "one", tmp_path / "ref", tmp_path / "run"
    assert train(one, "rollout.mode=async", "trainer.total_steps=1").returncode == 0
    assert train(ref, *over, ranks=2).returncode == 0
    with open_journal_reader(one / "journal") as a, open_journal_reader(ref / "journal") as b:
        ours, theirs = b.read_step(1).first("buffer.add")["samples"], a.read_step(1).first("buffer.add")["samples"]
    for col in ("prompt_ids", "response_ids", "gen_logprobs"):
        assert [x.tolist() for x in ours[col]] == [y.tolist() for y in theirs[col]], col
    assert train(run, *over, ranks=2, VERLJ_FAILPOINT="async.push:1").returncode != 0
    out = train(run, *over, ranks=2, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(ref, run)


@pytest.mark.parametrize("over, says", [
    (["rollout.mode=async", "rollout.max_staleness=0"], "rollout.max_staleness must be an integer of at least 1, got 0"),
    (["rollout.max_staleness=2"], "rollout.max_staleness applies to rollout.mode=async only"),
    (["rollout.mode=async", "rollout.async_order=fifo"], "rollout.async_order must be one of step, completion"),
    (["rollout.mode=async", "rollout.async_order=completion", "distributed.tensor_parallel_size=2"],
     "rollout.async_order=completion does not combine with tensor parallelism yet"),
    (["rollout.async_order=completion"], "rollout.async_order applies to rollout.mode=async only"),
    (["rollout.mode=turbo"], "rollout.mode must be one of sync, async"),
])
def test_bad_async_values_end_in_one_line_and_write_nothing(tmp_path, over, says):
    run = tmp_path / "run"
    if over == ["rollout.mode=turbo"]:  # one through the real command in a process of its own: one line on stderr, exit 2
        out = train(run, *over)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and says in out.stderr, out.stderr
    else:  # the rest on the call `verlj train` makes, which prints "error: " + the sentence and exits with its exit_code
        with pytest.raises(VerljError) as refused:
            run_train(run, None, [*TINY, *over])
        assert refused.value.exit_code == 2 and "\n" not in str(refused.value) and says in str(refused.value), str(refused.value)
    assert not run.exists()


def test_mode_and_staleness_are_fixed_for_a_run(tmp_path, reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run, symlinks=True)
    before = fingerprints(run)
    for change in ("rollout.mode=sync", "rollout.max_staleness=3", "rollout.async_order=completion"):
        out = train(run, *ASYNC, change, "trainer.total_steps=8", resume=True)
        assert out.returncode == 2 and change.split("=")[0] in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert fingerprints(run) == before
