"""Crash recovery and replay, with real SIGKILLs of real `verlj train` processes.

Every scenario ends with the full journal (indices, seeds, samples, metrics other than timings,
fingerprints) equal, step for step, to an uninterrupted run's.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.journal import Journal, verify_journal
from verlj_testing import TINY, assert_same_journal, children, cli, env, fingerprints, popen, train, verlj

TARGET = 7
COMMON = [f"trainer.total_steps={TARGET}", "trainer.save_interval=2", "trainer.save_total_limit=2"]
GRPO_DYN = [*COMMON, "algorithm.dynamic_sampling=true", "rollout.n=2", "distributed.zero_stage=1"]
PPO_Z3 = [*COMMON, "algorithm.name=ppo", "distributed.zero_stage=3"]


class References(dict):
    """The uninterrupted runs by algorithm, each trained the first time a test asks for it (a sample of this module, run
    alone by test_forked_as_fresh, trains only the one it compares with)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        run_train(self.root / name, None, [*TINY, *{"grpo": GRPO_DYN, "ppo": PPO_Z3}[name]])
        self[name] = self.root / name
        return self[name]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def ref8(tmp_path_factory):
    """The uninterrupted 8-step GRPO run two tests extend their resumed runs to (trained once)."""
    run = tmp_path_factory.mktemp("ref8") / "run"
    run_train(run, None, [*TINY, *GRPO_DYN, "trainer.total_steps=8"])
    return run


@pytest.fixture(scope="module")
def killed_after_5(tmp_path_factory):
    """A PPO/ZeRO-3 run SIGKILLed (a real kill -9, at a failpoint) right after step 5 committed: step 5 needs
    replaying from step_00004 on resume. Made once; each test resumes a copy of its own."""
    run = tmp_path_factory.mktemp("killed5") / "run"
    assert train(run, *PPO_Z3, VERLJ_FAILPOINT="journal.after_commit:5").returncode == -9
    return run


def copy_of(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def resume_until_done(run, over, tries=6, **env_extra):
    for _ in range(tries):
        out = train(run, *over, resume=True, **env_extra)
        if out.returncode == 0:
            return out
        assert out.returncode == -9, out.stderr[-3000:]  # only our own kills may stop it
        env_extra = {}
    raise AssertionError("did not finish")


def journal_ok(run):
    with Journal.open_reader(run / "journal") as j:
        report = verify_journal(j)
        return report.ok, j.last_step()


@pytest.mark.parametrize(
    "algo, first, then",
    [
        # inside the LMDB transaction of step 3; resumed, the old snapshot unindexed, not yet deleted (step 6's rotation)
        ("grpo", "journal.before_commit:3", "snapshot.rotate:1"),
        # update done, step 4 not journaled; resumed (from step_00002), step_00004 renamed into place, not in the index
        ("ppo", "step.before_commit:4", "snapshot.before_index:1"),
    ],
)
def test_kills_at_failpoints_then_resume_is_exact(tmp_path, references, algo, first, then):
    """Killed at `first`, its resume killed at `then` (counted in the resumed process: where a fresh run's
    count would put it), then resumed to the end: the uninterrupted run's journal."""
    over = GRPO_DYN if algo == "grpo" else PPO_Z3
    run = tmp_path / "run"
    out = train(run, *over, VERLJ_FAILPOINT=first)
    assert out.returncode == -9, out.stderr[-3000:]
    ok, last = journal_ok(run)
    assert ok and last < TARGET
    out = train(run, *over, resume=True, VERLJ_FAILPOINT=then)
    assert out.returncode == -9, out.stderr[-3000:]
    assert "Resuming from checkpoint" in out.stdout or "initial state" in out.stdout
    ok, last_then = journal_ok(run)
    assert ok and last < last_then < TARGET
    out = resume_until_done(run, over)
    assert "Resuming from checkpoint" in out.stdout or "initial state" in out.stdout
    if then.startswith("snapshot.before_index"):  # a valid published snapshot is adopted, never deleted
        assert "Adopted step_00004: published but not indexed" in out.stdout, out.stdout
        assert "Resuming from checkpoint" in out.stdout and "step_00004" in out.stdout
    assert_same_journal(run, references[algo])
    assert journal_ok(run) == (True, TARGET)


def test_verify_says_what_the_next_resume_does_with_each_leftover_and_it_does_that(tmp_path, references):
    """One plan (SnapshotStore.plan_leftovers): verify prints it, the resume carries it out. A kill
    after step_00006 was published and before it was indexed; then, by hand, a copy of step_00004
    named step_00005, a temporary, and step_00002 deleted."""
    run = tmp_path / "run"
    out = train(run, *GRPO_DYN, VERLJ_FAILPOINT="snapshot.before_index:3")
    assert out.returncode == -9, out.stderr[-3000:]
    shutil.copytree(run / "step_00004", run / "step_00005")
    (run / ".tmp-step_00009").mkdir()
    shutil.rmtree(run / "step_00002")
    v = cli("verify", run)
    assert v.returncode == 0, v.stdout  # nothing resume uses is damaged
    plan = [
        "· .tmp-step_00009: left by an interrupted run; never used, and the next --resume removes it",
        "· step_00005: published but not in the index, and its meta says step 4, its name and the index say 5: the next "
        "--resume quarantines it (moves it to quarantine/)",
        "· step_00006: published but not in the index (the run stopped before indexing it); its manifest, step and fingerprint "
        "agree with the journal: the next --resume adopts it into the index",
        "⚠ step_00002 is in the index but not on disk (deleted by hand?): the next --resume removes it from the index; it is "
        "never counted, rotated against or pruned against",
        "Resume is possible from step_00006.",
    ]
    for line in plan:
        assert line in v.stdout.splitlines(), v.stdout
    planned = {x["name"]: x["action"] for x in json.loads(cli("verify", run, "--json").stdout)["next_resume"]}
    assert planned == {".tmp-step_00009": "remove", "step_00005": "quarantine", "step_00006": "adopt", "step_00002": "unindex"}
    out = resume_until_done(run, GRPO_DYN)
    done = [
        "[INFO] Removed what an interrupted run left behind: .tmp-step_00009",
        "[INFO] Quarantined step_00005 to quarantine/step_00005: published but not indexed, and its meta says step 4, its "
        "name and the index say 5",
        "[INFO] Adopted step_00006: published but not indexed when the run stopped; its manifest, step and fingerprint agree "
        "with the journal",
        f"[INFO] Resuming from checkpoint: {run / 'step_00006'}",
    ]
    for line in done:
        assert line in out.stdout.splitlines(), out.stdout
    warned = "[WARNING] step_00002 is in the index but not on disk (deleted by hand?): removed from the index"
    assert warned in out.stderr.splitlines() and "Skipping" not in out.stderr, out.stderr
    assert_same_journal(run, references["grpo"])
    after = cli("verify", run)
    assert after.returncode == 0 and "next --resume" not in after.stdout, after.stdout
    assert "· step_00002 was in the index but not on disk (deleted by hand?); a resume removed it from the index" in after.stdout


def test_kill_during_the_replay_of_a_resume(tmp_path, references, killed_after_5):
    run = copy_of(killed_after_5, tmp_path)
    # step 5 needs replaying from step_00004; die in the middle of that replay, then resume again
    out = train(run, *PPO_Z3, resume=True, VERLJ_FAILPOINT="replay.step:1")
    assert out.returncode == -9
    out = resume_until_done(run, PPO_Z3)
    assert "Replayed step 5 from the journal." in out.stdout
    assert_same_journal(run, references["ppo"])


def test_sigint_during_the_replay_of_a_resume_trains_nothing_new(tmp_path, references, killed_after_5):
    run = copy_of(killed_after_5, tmp_path)
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *PPO_Z3, "--resume"]
    p = popen(cmd, env=env(VERLJ_FAILPOINT="replay.step:1:sleep=3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if "Resuming from checkpoint" in line:  # step 5 is replayed next, stalled 3 s: the signal lands inside it
            time.sleep(1.0)
            p.send_signal(signal.SIGINT)
            break
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert "Received SIGINT during the resume: its replay reached step 5; nothing new trained; exiting." in rest
    assert "Step 6: reward" not in rest and "Saving checkpoint" not in rest  # it trained and snapshotted step 6 before
    assert journal_ok(run) == (True, 5) and not (run / "step_00006").exists()
    resume_until_done(run, PPO_Z3)
    assert_same_journal(run, references["ppo"])


def kill_at_random(run, over, rng, ranks=1, group=True):
    """Start `verlj train`, SIGKILL its whole process group (group=False: the trainer alone) after a
    random number of steps and a random delay. Returns the pids of the trainer's children then."""
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *over, "--resume"]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), *cmd[1:]]
        cmd[cmd.index("verlj.cli") - 1 : cmd.index("verlj.cli")] = ["-m"]
    p = popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    want = rng.randint(1, 3)
    seen = 0
    for line in p.stdout:
        if "[INFO] Step" in line and ": reward=" in line:
            seen += 1
            if seen >= want:
                time.sleep(rng.uniform(0.0, 0.15))
                break
    kids = children(p.pid) if group is False else []
    try:
        if group:
            os.killpg(p.pid, signal.SIGKILL)
        else:
            p.kill()
    except ProcessLookupError:  # it finished the run in the delay (or printed its last step and exited): then it ended cleanly
        assert p.wait() == 0, f"the run ended on its own before the kill, with exit status {p.returncode}"
    p.wait()
    return kids


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_random_kills_then_resume_is_exact(tmp_path, references, algo):
    over = GRPO_DYN if algo == "grpo" else PPO_Z3
    rng = random.Random(7 if algo == "grpo" else 11)
    run = tmp_path / "run"
    for _ in range(2):
        kill_at_random(run, over, rng)
        ok, _ = journal_ok(run)
        assert ok
    resume_until_done(run, over)
    assert_same_journal(run, references[algo])


def test_save_total_limit_and_layout(references):
    run = references["grpo"]
    snaps = sorted(p.name for p in run.iterdir() if p.name.startswith("step_"))
    assert snaps == ["step_00006", "step_00007"]
    assert os.readlink(run / "latest") == "step_00007"
    with Journal.open_reader(run / "journal") as j:
        assert sorted(j.meta.snapshots()) == [6, 7]
    assert not [p for p in run.iterdir() if p.name.startswith((".tmp", ".trash"))]
    md = json.loads((run / "train_metadata.json").read_text())
    assert md["global_step"] == TARGET and md["last_snapshot"] == "step_00007"
    for key in ("epoch", "samples_seen", "last_save_time", "git_commit", "config_hash", "resume_from"):
        assert key in md


@pytest.fixture(scope="module")
def keep_all(tmp_path_factory):
    run = tmp_path_factory.mktemp("keep") / "run"
    run_train(run, None, [*TINY, *GRPO_DYN, "trainer.save_total_limit=0"])
    return run


def replay_json(run, n):
    out = verlj("replay", run, "--to-step", n, "--json", check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def replay_here(run, n):
    """What `verlj replay RUN --to-step N --json` prints, from the calls it makes, in this process."""
    from verlj.engine.post_mortem import materialize

    return json.loads(materialize.replay_report(materialize.materialize(run, n)))


def test_replay_to_step_matches_the_live_run(keep_all, tmp_path):
    live = fingerprints(keep_all)
    # from the initial state and between snapshots on the replay itself, at a snapshot through the command
    for n, expect_from, replayed in ((1, 0, replay_here), (5, 4, replay_here), (7, 7, replay_json)):
        got = replayed(keep_all, n)
        assert got == {"step": n, "fingerprint": live[n], "from_snapshot": expect_from, "exact": True, "tolerant_steps": 0,
                       "max_deviation": None}


def test_a_replay_loads_no_reference_model(keep_all):
    """The run trains with GRPO's KL loss; its reference's log-probs are journaled with the samples, so a
    replay reads them and never loads the reference (the actor's initial weights: a second model)."""
    from verlj.engine.post_mortem import materialize

    replayed = materialize.materialize(keep_all, 5)
    assert replayed.run.trainer.cfg.model.actor.use_kl_loss and replayed.from_snapshot == 4
    assert replayed.fingerprint == fingerprints(keep_all)[5] and replayed.run.trainer.actor.ref is None


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_newer_snapshots_fall_back_and_stay_exact(keep_all, ref8, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(keep_all, run, symlinks=True)
    flip_byte(next((run / "step_00004" / "actor").iterdir()))
    flip_byte(run / "step_00006" / "dataflow_anchor.msgpack", 3)
    got = replay_here(run, 6)
    assert got == {"step": 6, "fingerprint": fingerprints(keep_all)[6], "from_snapshot": 2, "exact": True, "tolerant_steps": 0,
                   "max_deviation": None}
    # --resume skips the damaged newest snapshot too
    flip_byte(next((run / "step_00007" / "actor").iterdir()))
    out = train(run, *GRPO_DYN, "trainer.total_steps=8", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Skipping damaged snapshot" in out.stderr and "step_00007" in out.stderr
    assert "Resuming from checkpoint" in out.stdout and "step_00002" in out.stdout
    assert "Replayed steps 3–7 from the journal." in out.stdout
    assert_same_journal(run, ref8)


def test_replay_refuses_out_of_range_and_non_runs(keep_all, tmp_path):
    out = verlj("replay", keep_all, "--to-step", 99)
    assert out.returncode == 2 and "out of range" in out.stderr and "Traceback" not in out.stderr
    out = verlj("replay", tmp_path, "--to-step", 1)
    assert out.returncode == 1 and "is not a verlj run" in out.stderr


def test_export_and_snapshot_and_fork(keep_all, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = verlj("replay", keep_all, "--to-step", 5, "--export", tmp_path / "hf", "--snapshot", tmp_path / "s5", check=True)
    assert "fingerprint" in out.stdout
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert model.config.vocab_size == len(tok)
    assert (tmp_path / "s5" / "manifest.json").is_file() and json.loads((tmp_path / "s5" / "meta.json").read_text())["step"] == 5
    # fork at 5 with a new learning rate, two more steps
    out = verlj("replay", keep_all, "--to-step", 5, "--fork", tmp_path / "fork", "model.actor.optim.lr=0.0005", check=True)
    with Journal.open_reader(tmp_path / "fork" / "journal") as j:
        assert j.base_step() == 5 and j.last_step() == TARGET
        assert j.meta.get("parent")["step"] == 5
        assert verify_journal(j).ok
        first = j.read_step(6)
    assert any(e["type"] == "control" and e["kind"] == "fork" for e in first.events)
    assert fingerprints(tmp_path / "fork")[6] != fingerprints(keep_all)[6]  # the new lr changed the update
    # the fork resumes exactly like any run
    fork_fp = fingerprints(tmp_path / "fork")[TARGET]
    assert replay_here(tmp_path / "fork", TARGET)["fingerprint"] == fork_fp


def test_config_change_on_resume(tmp_path, references):
    run = tmp_path / "run"
    run_train(run, None, [*TINY, *GRPO_DYN, "trainer.total_steps=4"])
    out = train(run, *GRPO_DYN, "trainer.total_steps=5", "model.actor.clip_ratio=0.1", resume=True)
    assert out.returncode == 2 and "model.actor.clip_ratio" in out.stderr and "--allow-config-change" in out.stderr
    out = train(run, *GRPO_DYN, "trainer.total_steps=5", "data.prompts_per_step=8", "--allow-config-change", resume=True)
    assert out.returncode == 2 and "data.prompts_per_step cannot change within a run" in out.stderr
    # extending the run is always allowed, and recorded
    out = train(run, *GRPO_DYN, "trainer.total_steps=5", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    out = train(run, *GRPO_DYN, "trainer.total_steps=6", "model.actor.clip_ratio=0.1", "--allow-config-change", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    with Journal.open_reader(run / "journal") as j:
        ev6 = {e["type"]: e for e in j.read_step(6).events}
        assert ev6["config"]["changed"] == ["model.actor.clip_ratio", "trainer.total_steps"]
        assert [h["from_step"] for h in j.meta.get("config_history")] == [5, 6]
    # replay applies each step under the config in force then: steps 5 and 6 check out from step 4's snapshot
    assert replay_here(run, 6)["fingerprint"] == fingerprints(run)[6]


def signal_after(run, sig, marker, *extra, **env_extra) -> tuple[int, str, str]:
    """Start `verlj train`, send `sig` once a stdout line contains `marker`; (exit code, rest of stdout, stderr)."""
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *GRPO_DYN, *extra]
    p = popen(cmd, env=env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if marker in line:
            p.send_signal(sig)
            break
    rest, err = p.communicate(timeout=120)
    return p.returncode, rest, err


def test_graceful_sigint_then_resume(tmp_path, references):
    run = tmp_path / "run"
    code, rest, err = signal_after(run, signal.SIGINT, "[INFO] Step 2: reward")
    assert code == 0, err[-2000:]
    assert "Received SIGINT" in rest
    ok, last = journal_ok(run)
    assert ok and 2 <= last < TARGET
    assert (run / f"step_{last:05d}" / "manifest.json").is_file()
    out = train(run, *GRPO_DYN, resume=True)
    assert out.returncode == 0
    assert f"Resuming from checkpoint: {run / f'step_{last:05d}'}" in out.stdout
    assert_same_journal(run, references["grpo"])


def test_sigterm_and_double_sigint(tmp_path, references):
    run = tmp_path / "run"
    code, rest, _ = signal_after(run, signal.SIGTERM, "[INFO] Step 1: reward")
    assert code == 0 and "Received SIGTERM" in rest
    # a second SIGINT stops at once: stall step 2 (before its commit) to deliver both inside it
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *GRPO_DYN, "--resume"]
    p = popen(cmd, env=env(VERLJ_FAILPOINT="step.before_commit:1:sleep=30"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if "Continuing training" in line:
            time.sleep(1.0)
            p.send_signal(signal.SIGINT)
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            break
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Interrupted" in err and "Traceback" not in err
    assert journal_ok(run)[0]
    resume_until_done(run, GRPO_DYN)
    assert_same_journal(run, references["grpo"])


def test_async_save_matches_sync(tmp_path, references, ref8):
    """An async snapshot holds the live tensors and writes them while the loop goes on: its write is
    stalled 3 s before the first tensor (at 6), so the next step's update has to wait for it (or the snapshot
    at 6 would hold step 7's state, and the resume from it below would not match)."""
    run = tmp_path / "run"
    out = train(run, *GRPO_DYN, "trainer.async_save=true", VERLJ_FAILPOINT="snapshot.held:3:sleep=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "in the background" in out.stdout
    assert_same_journal(run, references["grpo"])
    with Journal.open_reader(run / "journal") as j:
        assert sorted(j.meta.snapshots()) == [6, 7]
    # resume from an async snapshot: extend by one step, compare with a straight 8-step run
    flip_byte(next((run / "step_00007" / "actor").iterdir()))
    out = train(run, *GRPO_DYN, "trainer.total_steps=8", "trainer.async_save=true", resume=True)
    assert out.returncode == 0 and "step_00006" in out.stdout
    assert_same_journal(run, ref8)
