"""What a resume takes from the run and what from the command that starts it.

- A run that never committed a step resumes with the config it was started with, not the defaults.
- trainer.resume_from is the choice of the one resume that names it: recorded in the lineage, never
  the run's config, so the next plain --resume starts from the newest snapshot again.
- Library versions that changed since the last start are said and recorded.
- A fork whose config the fork would refuse is refused before anything is replayed.
"""

from __future__ import annotations

from verlj.engine.loop.ledger import Ledger
from verlj.journal import Journal
from verlj_testing import SMALL, TINY, cli, train, verlj


def test_a_run_that_never_committed_resumes_with_its_stored_config(tmp_path):
    run = tmp_path / "r"
    out = verlj("train", "-o", run, *TINY, "model.tiny.num_heads=2", "rollout.n=2", VERLJ_FAILPOINT="step.before_commit:1")
    assert out.returncode == -9
    out = verlj("train", "-o", run, "--resume", "trainer.total_steps=1")  # names neither key: the stored ones hold
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"{run} held a run that never committed a step; starting it afresh with its stored config, changed by this "
            "command in trainer.total_steps.") in out.stdout
    with Ledger.open_reader(run) as ledger:
        cfg = ledger.identity.first_config()
    assert (cfg["model"]["tiny"]["num_heads"], cfg["rollout"]["n"], cfg["trainer"]["total_steps"]) == (2, 2, 1)


def test_resume_from_applies_to_the_resume_that_names_it(copy):
    out = train(copy, *SMALL, "trainer.total_steps=5", "trainer.resume_from=2", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Resuming from checkpoint: {copy / 'step_00002'}" in out.stdout and "Replayed steps 3–4 from the journal." in out.stdout
    out = train(copy, *SMALL, "trainer.total_steps=6", resume=True)  # a plain resume: the newest snapshot again
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Resuming from checkpoint: {copy / 'step_00005'}" in out.stdout and "Replayed" not in out.stdout
    with Ledger.open_reader(copy) as ledger:
        assert ledger.config_at(6)["trainer"]["resume_from"] is None
        resumes = [e for e in ledger.lineage.entries() if e.kind == "resume"]
    assert [e.resume_from for e in resumes] == ["2", None]
    assert "(asked: trainer.resume_from=2)" in cli("inspect", copy).stdout


def test_library_versions_that_changed_since_the_last_start_are_said_and_recorded(copy):
    with Journal.open_writer(copy / "journal") as j:
        j.meta.set("versions", {**j.meta.get("versions"), "transformers": "0.0.1"})
    out = train(copy, *SMALL, "trainer.total_steps=5", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    import transformers

    moved = f"transformers 0.0.1 → {transformers.__version__}"
    assert f"library versions changed since this run last started: {moved} (recorded in its lineage)" in out.stderr
    assert f"versions   changed at that resume: {moved}" in cli("inspect", copy).stdout
    again = train(copy, *SMALL, "trainer.total_steps=6", resume=True)  # compared with the last start: nothing moved
    assert again.returncode == 0 and "library versions changed" not in again.stderr


def test_a_fork_with_a_fixed_key_is_refused_before_the_replay(base, tmp_path):
    new = tmp_path / "fork"
    # a replay would hit this failpoint and be killed: the refusal must come first
    out = verlj("replay", base, "--to-step", 3, "--fork", new, "algorithm.name=ppo", VERLJ_FAILPOINT="replay.step:1")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == ("error: algorithm.name cannot change within a run (fork): it shapes the engines, the data or "
                                  "the random streams; start a new run with them (a fork may change live keys such as "
                                  "algorithm.gamma, and bookkeeping ones)")
    assert not new.exists()


def test_a_fork_that_changes_the_learning_rate_resumes_from_its_base_snapshot(base, tmp_path):
    """The fork's base snapshot holds the parent's state under the fork's config (the optimizer's lr
    is part of it), and records that state's fingerprint: a resume from it (a fork killed before its
    first snapshot of its own) loads it and replays the fork's steps exactly."""
    new = tmp_path / "fork"
    out = verlj("replay", base, "--to-step", 2, "--fork", new, "model.actor.optim.lr=0.003", "trainer.total_steps=3")
    assert out.returncode == 0, out.stderr[-2000:]
    out = verlj("train", "-o", new, "--resume", "trainer.resume_from=2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Resuming from checkpoint: {new / 'step_00002'}" in out.stdout and "Replayed step 3 from the journal." in out.stdout
    assert cli("verify", new).returncode == 0
