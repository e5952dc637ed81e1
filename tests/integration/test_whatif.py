"""`verlj whatif RUN --from-step A [--to-step B] -o NEW key=value`: RUN's steps re-trained on its
journaled samples. With RUN's own config every fingerprint is RUN's; a changed learning rate, KL
coefficient or reward function parts from RUN at step A+1; keys that would need new samples are
refused; NEW says it is counterfactual, is never forked, and a what-if killed (kill -9) and resumed
is bit-identical to one that was not."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem.counterfactual import whatif
from verlj.engine.post_mortem.rerun import rerun
from verlj.journal import JournalError, VerljError, open_journal_reader
from verlj_testing import TINY, assert_same_journal, cli, env, fingerprints, popen, replay_here, verlj

REWARD = "from verlj.engine.rl.rewards import add_reward\n\ndef negated(prompt, response, answer):\n    return -add_reward(prompt, response, answer)\n"


@pytest.fixture(scope="module")
def parent(tmp_path_factory, reference_run):
    """A directory with the run (a 4-step run: test_algorithm_runs's grpo, trained once) and the reward module."""
    root = tmp_path_factory.mktemp("whatif")
    (root / "wirew.py").write_text(REWARD)
    reference_run(root / "run", [*TINY, "trainer.total_steps=4", "trainer.save_interval=2", "trainer.save_total_limit=0"])
    return root


@pytest.fixture(scope="module")
def whatifs(parent):
    """`whatif RUN --from-step 2 --to-step 4` with one override (None: the run's own config), each made once
    per module on first use; the tests only read them."""
    names = {None: "three_same", "model.actor.optim.lr=0.003": "three_lr", "model.actor.kl_loss_coef=0.5": "three_kl",
             "rollout.reward_fn=wirew:negated": "negated"}
    made = {}

    def get(override):
        if override not in made:
            new = parent / names[override]
            assert whatif(parent / "run", 2, 4, new, [override] if override else []) == (3, 4)
            made[override] = new
        return made[override]

    return get


def test_a_whatif_with_the_runs_own_config_reproduces_every_fingerprint(parent):
    for a in (1, 2):  # from the initial state replayed, from a snapshot
        new = parent / f"same{a}"
        assert whatif(parent / "run", a, None, new, []) == (a + 1, 4)
        want = fingerprints(parent / "run")
        assert fingerprints(new) == {s: want[s] for s in range(a + 1, 5)}


@pytest.mark.parametrize("override", ["model.actor.optim.lr=0.003", "model.actor.kl_loss_coef=0.5", "rollout.reward_fn=wirew:negated"])
def test_a_changed_lr_kl_or_reward_parts_from_the_run_at_the_first_step(parent, whatifs, override, monkeypatch):
    monkeypatch.syspath_prepend(str(parent))
    new = whatifs(override)
    mine, theirs = fingerprints(new), fingerprints(parent / "run")
    assert sorted(mine) == [3, 4] and all(mine[s] != theirs[s] for s in (3, 4))
    with open_journal_reader(new / "journal") as j, open_journal_reader(parent / "run" / "journal") as p:
        got, was = j.read_step(3).first("buffer.add")["samples"], p.read_step(3).first("buffer.add")["samples"]
        assert (got["response_ids"] == was["response_ids"]).all()  # the same samples, never generated again
        if "reward_fn" in override:  # scored again with the what-if's reward
            assert (got["score"] == -was["score"]).all() and (got["score"] != 0).any()
        else:
            assert (got["score"] == was["score"]).all()


def test_keys_that_need_new_samples_are_refused_in_one_line(parent):
    new = parent / "refused"
    # the command, in a process of its own: the engine's refusal is its one line on stderr and its exit code
    key = "rollout.temperature=0.5"
    out = verlj("whatif", parent / "run", "--from-step", "2", "-o", new, key)
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert out.stderr.startswith(f"error: {key.split('=')[0]} cannot change in a what-if"), out.stderr
    assert not new.exists()
    # the other keys and the range, refused by the engine call the command makes (the sentence and exit code
    # the CLI prints and exits with: VerljError -> "error: " + str(e), e.exit_code)
    for key in ("rollout.n=2", "rollout.max_response_length=8"):
        with pytest.raises(VerljError) as refused:
            whatif(parent / "run", 2, None, new, [key])
        assert refused.value.exit_code != 0 and "\n" not in str(refused.value), str(refused.value)
        assert str(refused.value).startswith(f"{key.split('=')[0]} cannot change in a what-if"), str(refused.value)
        assert not new.exists()
    with pytest.raises(VerljError) as refused:
        whatif(parent / "run", 4, None, new, [])
    assert refused.value.exit_code == 2 and "out of range" in str(refused.value) and not new.exists()


def test_a_whatif_says_so_and_is_never_forked(parent):
    new = parent / "shown"
    out = verlj("whatif", parent / "run", "--from-step", "2", "--to-step", "3", "-o", new, "model.actor.optim.lr=0.002")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"Done: what-if {new} of {parent / 'run'}, steps 3–3 re-trained on its samples (counterfactual)"
    shown = cli("inspect", new).stdout
    assert f"COUNTERFACTUAL: steps 3–3 re-trained on the samples of {(parent / 'run').resolve()}" in shown
    assert "changed: model.actor.optim.lr=0.002" in shown and "a what-if of" in shown
    with open_journal_reader(new / "journal") as j:
        cf = j.meta.get("counterfactual")
    assert (cf["from_step"], cf["to_step"], cf["changed"]) == (2, 3, ["model.actor.optim.lr"])
    # a real run: verify, replay and rerun take it (exit 0); the latter two by the calls the commands make, in this process
    assert cli("verify", new).returncode == 0
    replay_here(new, 3)
    assert rerun(new, 3, 3).to_dict()["reproduced"]  # `verlj rerun` exits 0 on this
    for args in (("replay", new, "--to-step", "3", "--fork", parent / "fork"), ("whatif", new, "--from-step", "2", "-o", parent / "fork")):
        refused = verlj(*args)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert "is a what-if of" in refused.stderr and "its samples were not drawn by its own policy" in refused.stderr
        assert not (parent / "fork").exists()


def test_a_whatif_with_local_dir_verifies_and_resumes_exactly(parent, tmp_path):
    """A what-if whose journal is shipped (journal.local_dir): its segments verify (they were called
    damaged, and closing it waited 10 minutes for steps it never holds), and stopped at step 3, its
    node lost, it resumes from them alone to the steps of the what-if that ran straight to 4."""
    straight, new, local = tmp_path / "straight", tmp_path / "new", tmp_path / "L"
    assert whatif(parent / "run", 2, 4, straight, ["model.actor.optim.lr=0.003"]) == (3, 4)
    out = verlj("whatif", parent / "run", "--from-step", "2", "--to-step", "3", "-o", new, "model.actor.optim.lr=0.003",
                f"journal.local_dir={local}", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    v = cli("verify", new)
    assert v.returncode == 0 and "steps through 3" in v.stdout, v.stdout
    shutil.rmtree(local)  # the node is lost: only the run directory is left
    out = verlj("train", "--output-dir", new, "--resume", "trainer.total_steps=4", f"journal.local_dir={tmp_path / 'L2'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Rebuilt the journal" in out.stdout, out.stdout
    assert_same_journal(straight, new)
    assert fingerprints(new) == fingerprints(straight) and sorted(fingerprints(new)) == [3, 4]
    assert cli("verify", new).returncode == 0


def test_a_whatif_killed_at_a_random_moment_and_resumed_is_bit_identical(tmp_path):
    run = tmp_path / "run"
    run_train(run, None, [*TINY, "trainer.total_steps=10", "trainer.save_interval=3", "trainer.save_total_limit=0"])
    whatif(run, 1, None, tmp_path / "straight", ["model.actor.optim.lr=0.002"])
    # once before the what-if's first snapshot after its base (recovery starts from the base), once anywhere
    for at in (2, random.Random(os.getpid()).randint(3, 8)):
        killed = tmp_path / f"killed{at}"
        kill_during(run, killed, at)
        out = verlj("train", "--output-dir", killed, "--resume")
        assert out.returncode == 0, out.stderr[-3000:]
        assert_same_journal(killed, tmp_path / "straight")
        assert fingerprints(killed) == fingerprints(tmp_path / "straight") and sorted(fingerprints(killed)) == list(range(2, 11))


def kill_during(run, new, at: int) -> None:
    """`verlj whatif RUN --from-step 1 -o NEW` (lr 0.002), killed with SIGKILL once its step `at` is committed."""
    cmd = [sys.executable, "-m", "verlj.cli", "whatif", str(run), "--from-step", "1", "-o", str(new), "model.actor.optim.lr=0.002"]
    proc = popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            with open_journal_reader(new / "journal") as j:
                if j.last_step() >= at:
                    break
        except JournalError:  # not created yet
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the what-if ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with open_journal_reader(new / "journal") as j:
        assert at <= j.last_step() < 10


def test_each_whatif_step_journals_how_far_its_policy_drifted(parent, whatifs, monkeypatch):
    """whatif/drift/*: |log pi_whatif - log pi_gen| over the response tokens. With the run's own config
    it is the run's own rollout/logprob_diff and no correction is applied; the off-policy correction
    (the async objective's truncated importance weights) applies from the first step whose starting
    state is not the run's: at once with another lr (the optimizer's state), a step later with
    another reward (the state after A is still the run's)."""
    monkeypatch.syspath_prepend(str(parent))
    runs = {over: whatifs(over) for over in [None, "model.actor.optim.lr=0.003", "rollout.reward_fn=wirew:negated"]}
    with open_journal_reader(parent / "run" / "journal") as j:
        theirs = {s: j.read_step(s).metrics for s in (3, 4)}

    def metrics(new):
        with open_journal_reader(new / "journal") as j:
            return {s: j.read_step(s).metrics for s in (3, 4)}

    same, lr, reward = (metrics(new) for new in runs.values())
    for s in (3, 4):
        assert same[s]["whatif/off_policy_correction"] == 0.0
        assert same[s]["whatif/drift/mean"] == theirs[s]["rollout/logprob_diff/mean"]
        assert same[s]["whatif/drift/max"] == theirs[s]["rollout/logprob_diff/max"]
        assert lr[s]["whatif/off_policy_correction"] == 1.0
        assert 0.0 <= lr[s]["whatif/is_clipped_frac"] <= 1.0 and 0 < lr[s]["whatif/is_weight/mean"] <= lr[s]["whatif/is_weight/max"]
    assert lr[4]["whatif/drift/mean"] != theirs[4]["rollout/logprob_diff/mean"]
    assert [reward[s]["whatif/off_policy_correction"] for s in (3, 4)] == [0.0, 1.0]


def test_metrics_draws_a_whatif_beside_its_run(parent, whatifs):
    lr, same = whatifs("model.actor.optim.lr=0.003"), whatifs(None)
    out = cli("metrics", parent / "run", lr, "--plot", parent / "lr.png")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"wrote {parent / 'lr.png'} (the runs part at step 3)"
    assert (parent / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = cli("metrics", parent / "run", same, "--plot", parent / "same.png", "--names", "critic/score/mean")
    assert out.returncode == 0 and out.stdout.strip().endswith("(the runs never part)"), out.stderr[-2000:]
    bad = verlj("metrics", parent / "run", lr)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: a second run is drawn beside the first with --plot out.png only"


def test_metrics_draws_several_whatifs_beside_their_run(parent, whatifs):
    """`verlj metrics RUN NEW1 NEW2 NEW3 --plot`: one PNG, each run's parting step said in one line."""
    news = {name: whatifs(over) for name, over in (("lr", "model.actor.optim.lr=0.003"), ("kl", "model.actor.kl_loss_coef=0.5"),
                                                   ("same", None))}
    out = cli("metrics", parent / "run", *news.values(), "--plot", parent / "three.png")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        f"wrote {parent / 'three.png'} (three_lr parts at step 3; three_kl parts at step 3; three_same never parts)"
    )
    assert (parent / "three.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = verlj("metrics", parent / "run", *news.values())
    assert bad.returncode == 2 and bad.stderr.strip() == "error: a second run is drawn beside the first with --plot out.png only"
