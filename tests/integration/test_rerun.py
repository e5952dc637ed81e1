"""`verlj rerun` and the stage digests: a journal's steps re-executed here reproduce every stage; a
change to the code (an advantage scaled by 1 + 1e-6) is named by its stage and classified as
persistent, a change that happens once as transient; replay names the stage it diverged at."""

import json

import pytest

from verlj.engine.errors import ReplayError
from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem import materialize
from verlj.engine.post_mortem.rerun import rerun
from verlj.engine.rl import algorithms
from verlj.journal import open_journal_reader
from verlj_testing import TINY, verlj


@pytest.fixture(scope="module")
def journaled(tmp_path_factory):
    run = tmp_path_factory.mktemp("rerun") / "run"
    run_train(run, None, [*TINY, "trainer.total_steps=5", "trainer.save_interval=2", "trainer.save_total_limit=0",
                          "algorithm.name=ppo", "distributed.zero_stage=3"])
    return run


def test_every_step_journals_its_stages(journaled):
    with open_journal_reader(journaled / "journal") as j:
        rec = j.read_step(3)
    stages = rec.first("stages")
    assert list(stages["digests"]) == ["data", "samples", "scores", "old_logprobs", "values", "returns", "advantages",
                                       "loss", "grads", "grad_norm", "state"]
    s = stages["summary"]
    assert s["scores"]["n"] == 16 and s["scores"]["mean"] == pytest.approx(rec.metrics["critic/score/mean"], rel=1e-6)
    assert s["grad_norm"]["n"] == 2  # the critic's and the actor's optimizer step


def test_rerun_reproduces_and_exits_0(journaled):
    out = verlj("rerun", journaled, "--steps", "3:4", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["from_snapshot"] == 2 and [v["verdict"] for v in report["verdicts"]] == ["reproduced", "reproduced"]
    bad = verlj("rerun", journaled, "--steps", "4:9")
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: --steps 4:9 is out of range: {journaled} has steps 1–5"


def test_a_changed_computation_is_named_by_its_stage_and_persistent(journaled, monkeypatch):
    real = algorithms.whiten
    monkeypatch.setattr(algorithms, "whiten", lambda adv, *a, **k: real(adv, *a, **k) * (1 + 1e-6))
    report = rerun(journaled, 3, 4)
    first, second = report["verdicts"]
    assert (first["verdict"], first["stage"], first["kind"]) == ("differs", "advantages", "persistent")
    assert first["journaled"]["absmax"] != first["rerun"]["absmax"] and first["second"] == first["rerun"]
    assert second["verdict"] == "not checked" and not report["reproduced"]


def test_a_difference_that_does_not_repeat_is_transient(journaled, monkeypatch):
    real, calls = algorithms.whiten, []

    def once(adv, *a, **k):  # the step's second execution here computes what the journal holds
        calls.append(1)
        out = real(adv, *a, **k)
        return out * (1 + 1e-6) if len(calls) == 1 else out

    monkeypatch.setattr(algorithms, "whiten", once)
    report = rerun(journaled, 3, 3)
    (v,) = report["verdicts"]
    assert (v["verdict"], v["stage"], v["kind"]) == ("differs", "advantages", "transient")


def test_replay_names_the_stage_it_diverged_at(journaled, monkeypatch):
    real = algorithms.whiten
    monkeypatch.setattr(algorithms, "whiten", lambda adv, *a, **k: real(adv, *a, **k) * (1 + 1e-6))
    with pytest.raises(ReplayError, match="replay diverged at step 3: its advantages differ from the journal's"):
        materialize.materialize(journaled, 3)


def test_a_probe_measures_past_steps_on_their_journaled_state(journaled, tmp_path):
    """`verlj replay --steps A:B --probe module:function`: one JSON line a step, computed on what the
    step trains on and the model it starts from; a probe that fails is one line naming it."""
    (tmp_path / "my_probe.py").write_text(
        "def batch_stats(step, batch, model):\n"
        "    numel = sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters())\n"
        "    return {'probe/score': sum(s['score'] for s in batch) / len(batch), 'probe/samples': len(batch), 'probe/params': numel}\n"
        "def broken(step, batch, model):\n"
        "    raise ValueError('no such layer')\n"
    )
    out = verlj("replay", journaled, "--steps", "3:4", "--probe", "my_probe:batch_stats", PYTHONPATH=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    with open_journal_reader(journaled / "journal") as j:
        want = {s: j.read_step(s).metrics for s in (3, 4)}
    assert [r["step"] for r in rows] == [3, 4]
    for r in rows:
        assert r["probe/score"] == pytest.approx(want[r["step"]]["critic/score/mean"], rel=1e-6)
        assert r["probe/samples"] == want[r["step"]]["batch/samples"] and r["probe/params"] > 0
    bad = verlj("replay", journaled, "--steps", "3:3", "--probe", "my_probe:broken", PYTHONPATH=tmp_path)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: probe my_probe.broken raised ValueError: no such layer (step 3)"
