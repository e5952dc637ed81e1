"""rollout.async_order=completion: a free-running generator process; timing decides what each step
trains on, so a resumed run is not the uninterrupted one. What must hold across real SIGKILLs (of
the trainer at the failpoints of admit, push, consume and commit, and of the generator alone):
replay reproduces every journaled fingerprint, no completed sample is lost or trained twice, the
prompts are asked in the dataset's order with none skipped or repeated, and the groups in flight
at a kill are generated again from their seeds by the version the resume holds."""

from pathlib import Path

import numpy as np

from verlj.engine.config import config_from_dict
from verlj.engine.loop.ledger import open_run
from verlj.engine.post_mortem.rollouts import Accounting, group_accounting
from verlj.engine.rl.data import Sampler, load_data
from verlj.journal import open_journal_reader
from verlj_testing import cli, fingerprints, replay_here, train

# the generator 0.3 s slower per batch than it is (slower than the trainer), two rounds asked ahead (k = 2) and one generated at
# a time: groups are still queued at every commit
SLOW = "generator.before_reply:1:sleep-each=0.3"
FREE = ["rollout.mode=async", "rollout.async_order=completion", "rollout.max_staleness=2", "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=2",
        "trainer.total_steps=6", "trainer.save_interval=3"]


def kill_mid_episode_and_resume(run: Path, *over: str, **env) -> None:
    """Completion order with episodes: killed after step 1's commit, then with turns of groups asked ahead durable
    (episodes.after_durable), then resumed to the end: the committed steps unchanged, some groups durable at the second
    kill, every group accounted for (check_accounting)."""
    from verlj.engine.loop.ledger import Ledger

    out = train(run, *over, VERLJ_FAILPOINT="journal.after_commit:1", **env)
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True, VERLJ_FAILPOINT="episodes.after_durable:1", **env)
    assert out.returncode == -9, out.stderr[-3000:]
    with Ledger.open_reader(run) as ledger:
        committed = {s: ledger.journal.read_raw(s) for s in range(1, ledger.last_step() + 1)}
        durable = ledger.in_flight.groups()
    assert committed and durable
    out = train(run, *over, resume=True, **env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    with Ledger.open_reader(run) as ledger:
        assert {s: ledger.journal.read_raw(s) for s in committed} == committed
    check_accounting(run)


def check_accounting(run: Path) -> Accounting:
    """The journal's own account of every group, against the dataset's order (what tools/faults.py checks too)."""
    out = cli("verify", run)
    assert out.returncode == 0 and "✓ Rollout accounting (async completion order)" in out.stdout, out.stdout + out.stderr
    with open_run(run) as ledger:
        acc = group_accounting(ledger)
        cfg = config_from_dict(ledger.identity.all()["config"])
    for fault in ("arrived_twice", "arrived_unasked", "fate_twice", "fate_unarrived"):
        assert getattr(acc, fault) == [], fault
    # no prompt asked twice or skipped: the rows asked are the sampler's draws, in order
    size = len(load_data(cfg.data, cfg.trainer.seed).train)
    assert acc.rows == Sampler(size, cfg.trainer.seed).draw(len(acc.rows)).tolist()
    assert acc.trained == cfg.trainer.total_steps * cfg.data.prompts_per_step * cfg.rollout.n
    return acc


def test_kills_at_every_failpoint_and_of_the_generator_lose_no_sample_and_replay_exactly(tmp_path):
    run = tmp_path / "run"
    # step 1 asks k rounds ahead and the push waits for the first only: 4 groups are queued at its
    # commit, in flight when the next push is killed
    out = train(run, *FREE, VERLJ_FAILPOINT=f"{SLOW},async.push:2")
    assert out.returncode == -9, out.stderr[-3000:]
    kept = fingerprints(run)
    assert max(kept) == 1
    out = train(run, *FREE, resume=True, VERLJ_FAILPOINT="generator.before_reply:3")  # SIGKILL of the generator alone
    assert out.returncode == 1 and "the rollout generator process (pid " in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    for point in ("async.admit:2", "async.consume:1", "step.before_commit:1"):
        now = fingerprints(run)
        assert {s: now[s] for s in kept} == kept  # a committed step never changes
        kept = now
        out = train(run, *FREE, resume=True, VERLJ_FAILPOINT=f"{SLOW},{point}")
        assert out.returncode == -9, (point, out.stderr[-3000:])
    now = fingerprints(run)
    assert {s: now[s] for s in kept} == kept and max(now) < 6
    out = train(run, *FREE, resume=True, VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    acc = check_accounting(run)
    assert acc.regenerated > 0  # the kills did leave groups in flight
    with open_journal_reader(run / "journal") as j:
        records = {r.step: r for r in j.iter_steps()}
    again = 0
    for step, r in records.items():
        asked = r.first("buffer.request")
        regenerated = np.asarray(asked["regenerated"]).tolist()
        if regenerated:  # the first step of a process: generated again by the version it resumed with
            again += 1
            samples = r.first("buffer.add")["samples"]
            mine = np.isin(samples["group"], regenerated)
            assert set(samples["policy_version"][mine].tolist()) <= {step - 1}, step
        # each sample's version is the one that generated it: those of version step-1 are the
        # trainer's log-probs to the KV cache's rounding
        assert r.metrics["rollout/logprob_diff/max"] < 1e-5, step
        assert r.metrics["rollout/staleness/max"] <= 2
    assert again >= 1
    # replay reproduces the journal, which holds what timing decided
    assert replay_here(run, 5)[0]["fingerprint"] == fingerprints(run)[5]  # what `verlj replay RUN --to-step 5` prints
    out = cli("inspect", run, "--step", str(min(s for s, r in records.items() if len(r.first("buffer.request")["regenerated"]))), check=True)
    assert "async, completion order, max_staleness 2" in out.stdout and "asked again" in out.stdout


def test_two_ranks_zero2_ppo_completion_order_resume(tmp_path):
    over = ["rollout.mode=async", "rollout.async_order=completion", "rollout.max_staleness=2", "algorithm.name=ppo",
            "distributed.zero_stage=2", "trainer.total_steps=3", "trainer.save_interval=2"]
    run = tmp_path / "run"
    # step 1's look-ahead is still queued at the kill: the generator is a second per batch, far slower than a
    # step even when another test shares the cores (at 0.3 s a loaded trainer let it catch up: nothing in flight)
    slower = "generator.before_reply:1:sleep-each=1.0"
    out = train(run, *over, ranks=2, VERLJ_FAILPOINT=f"{slower},async.push:2")
    assert out.returncode != 0
    out = train(run, *over, ranks=2, resume=True, VERLJ_FAILPOINT=slower)
    assert out.returncode == 0, out.stderr[-3000:]
    assert check_accounting(run).regenerated > 0
