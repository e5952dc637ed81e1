"""`verlj rerun` and the stage digests: a journal's steps re-executed here reproduce every stage; a
change to the code (an advantage scaled by 1 + 1e-6) is named by its stage and classified as
persistent, a change that happens once as transient; replay names the stage it diverged at."""

import json
import re

import pytest

from verlj.engine.errors import ReplayError
from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem import materialize
from verlj.engine.post_mortem.rerun import render, rerun
from verlj.engine.rl import algorithms
from verlj.journal import open_journal_reader
from verlj_testing import TINY, cli, train, verlj


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
    # the call `verlj rerun RUN --steps 3:4 --json` makes, in this process: it prints the report as JSON,
    # and exits 0 when it says every step reproduced
    report = json.loads(json.dumps(rerun(journaled, 3, 4).to_dict()))
    assert report["reproduced"]
    assert report["from_snapshot"] == 2 and [v["verdict"] for v in report["verdicts"]] == ["reproduced", "reproduced"]
    bad = verlj("rerun", journaled, "--steps", "4:9")
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: --steps 4:9 is out of range: {journaled} has steps 1–5"


def test_a_changed_computation_is_named_by_its_stage_and_persistent(journaled, monkeypatch):
    real = algorithms.whiten
    monkeypatch.setattr(algorithms, "whiten", lambda adv, *a, **k: real(adv, *a, **k) * (1 + 1e-6))
    report = rerun(journaled, 3, 4).to_dict()
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
    report = rerun(journaled, 3, 3).to_dict()
    (v,) = report["verdicts"]
    assert (v["verdict"], v["stage"], v["kind"]) == ("differs", "advantages", "transient")


def test_rerun_finds_a_flipped_gradient_bit_and_a_flipped_parameter_bit(tmp_path):
    """Silent data corruption in a live run (the update.grads / update.params failpoints flip one
    mantissa bit): rerun names exactly those steps and stages, goes on from the next snapshot, and
    reproduces every other step; the same code and versions are recorded, so the run's own
    execution is blamed."""
    run = tmp_path / "run"
    out = train(run, "trainer.total_steps=6", "trainer.save_total_limit=0", "distributed.zero_stage=1",
                VERLJ_FAILPOINT="update.grads:2:flip=3,update.params:4:flip=9")
    assert out.returncode == 0, out.stderr[-2000:]
    out = verlj("rerun", run, "--steps", "1:6", "--json")
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout)
    got = [(v["step"], v["verdict"], v["stage"], v["kind"]) for v in report["verdicts"]]
    assert got == [(1, "reproduced", None, None), (2, "differs", "grads", "persistent"), (3, "reproduced", None, None),
                   (4, "differs", "state", "persistent"), (5, "reproduced", None, None), (6, "reproduced", None, None)]
    assert report["restarted_from"] == [2, 4] and report["versions_changed"] == {} and report["source_recorded"]
    text = render(report)
    assert "step 2: differs at grads" in text and "the run's own execution of this step went wrong" in text


def test_replay_names_the_stage_it_diverged_at(journaled, monkeypatch):
    real = algorithms.whiten
    monkeypatch.setattr(algorithms, "whiten", lambda adv, *a, **k: real(adv, *a, **k) * (1 + 1e-6))
    with pytest.raises(ReplayError, match="replay diverged at step 3: its advantages differ from the journal's"):
        materialize.materialize(journaled, 3)


def test_a_probe_measures_past_steps_on_their_journaled_state(journaled, tmp_path):
    """`verlj replay --steps A:B --probe module:function`: one JSON line a step, computed on what the
    step trains on and the model it starts from, stored beside the journal (whose chain it leaves as
    it was) and shown by metrics, find and inspect; `--workers 2` splits the range at a snapshot and
    measures the same numbers; a probe that fails is one line naming it, and nothing is stored."""
    (tmp_path / "my_probe.py").write_text(
        "def batch_stats(step, batch, model):\n"
        "    numel = sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters())\n"
        "    return {'score': sum(s['score'] for s in batch) / len(batch), 'samples': len(batch), 'params': numel}\n"
        "batch_stats.version = '1'\n"
        "def broken(step, batch, model):\n"
        "    raise ValueError('no such layer')\n"
    )
    with open_journal_reader(journaled / "journal") as j:
        chain = j.chain_hash(5)
        want = {s: j.read_step(s).metrics for s in (3, 4, 5)}
    out = verlj("replay", journaled, "--steps", "3:4", "--probe", "my_probe:batch_stats", PYTHONPATH=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    for r in rows:
        assert r["score"] == pytest.approx(want[r["step"]]["critic/score/mean"], rel=1e-6)
        assert r["samples"] == want[r["step"]]["batch/samples"] and r["params"] > 0
    two = verlj("replay", journaled, "--steps", "3:5", "--probe", "my_probe:batch_stats", "--workers", "2", PYTHONPATH=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "in 2 processes (3–4, 5–5)" in two.stderr  # split after the snapshot of step 4
    assert [json.loads(line) for line in two.stdout.splitlines()][:2] == rows
    shown = json.loads(cli("metrics", journaled, "--names", "probe/my_probe.batch_stats/score", "--jsonl").stdout.splitlines()[2])
    assert shown["step"] == 3 and shown["probe/my_probe.batch_stats/score"] == rows[0]["score"]
    assert "3 step(s) match" in cli("find", journaled, "--where", "probe/my_probe.batch_stats/samples > 0").stdout
    assert "probe/my_probe.batch_stats/score" in cli("inspect", journaled, "--step", "4").stdout
    assert "probe      my_probe.batch_stats version 1: steps 3–5 (3)" in cli("inspect", journaled).stdout
    with open_journal_reader(journaled / "journal") as j:
        assert j.chain_hash(5) == chain
    before = (journaled / "derived" / "my_probe.batch_stats.msgpack").read_bytes()
    bad = verlj("replay", journaled, "--steps", "3:3", "--probe", "my_probe:broken", PYTHONPATH=tmp_path)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: probe my_probe.broken raised ValueError: no such layer (step 3)"
    assert not (journaled / "derived" / "my_probe.broken.msgpack").exists()
    assert (journaled / "derived" / "my_probe.batch_stats.msgpack").read_bytes() == before


def test_bad_probes_are_one_line_each_and_store_nothing(journaled, tmp_path, monkeypatch):
    from verlj.engine.errors import PluginError
    from verlj.engine.post_mortem.probe import probe_steps
    from verlj.engine.post_mortem.rerun import StepsError

    (tmp_path / "odd_probe.py").write_text("def words(step, batch, model):\n    return {'x': 'high'}\n"
                                           "def two_args(step, batch):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stored = sorted((journaled / "derived").glob("*")) if (journaled / "derived").exists() else []
    for spec, says in (("odd_probe:words", "returned {'x': 'high'} at step 3; it must return {name: finite number}"),
                       ("odd_probe:two_args", "has the wrong signature"),
                       ("no_such_module:fn", "cannot import 'no_such_module:fn'")):
        with pytest.raises(PluginError, match=re.escape(says)):
            probe_steps(journaled, 3, 3, spec)
    with pytest.raises(StepsError, match="out of range"):
        probe_steps(journaled, 0, 2, "odd_probe:words")
    assert (sorted((journaled / "derived").glob("*")) if (journaled / "derived").exists() else []) == stored


# ----------------------------------------------------------------------------- rerun scores the samples again


def test_rerun_scores_again_with_the_reward_module_as_it_is_now(tmp_path):
    """A user reward module (rollout.reward_fn=rrrew:score): unchanged, rerun reproduces; edited after
    the run, the step differs at scores, persistent, naming the module's digest change and the first
    sample scored otherwise with both values."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "rrrew.py").write_text("from verlj.engine.rl.rewards import add_reward\n\n"
                                   "def score(prompt, response, answer):\n    return add_reward(prompt, response, answer)\n")
    run = tmp_path / "run"
    out = train(run, "trainer.total_steps=3", "rollout.reward_fn=rrrew:score", PYTHONPATH=code)
    assert out.returncode == 0, out.stderr[-2000:]
    with open_journal_reader(run / "journal") as j:
        recorded = j.meta.get("versions")["reward module rrrew"]
        first = j.read_step(3).first("buffer.add")["samples"]
    same = verlj("rerun", run, "--steps", "3:3", PYTHONPATH=code)
    assert same.returncode == 0, same.stderr[-2000:]
    assert "step 3: reproduced" in same.stdout and "rescore-model" not in same.stdout
    (code / "rrrew.py").write_text("from verlj.engine.rl.rewards import add_reward\n\n"
                                   "def score(prompt, response, answer):\n    return add_reward(prompt, response, answer) + 0.25\n")
    changed = verlj("rerun", run, "--steps", "3:3", "--json", PYTHONPATH=code)
    assert changed.returncode == 1, changed.stderr[-2000:]
    report = json.loads(changed.stdout)
    (v,) = report["verdicts"]
    assert (v["verdict"], v["stage"], v["kind"]) == ("differs", "scores", "persistent")
    now = report["versions_changed"]["reward module rrrew"]
    assert now[0] == recorded and now[1] != recorded and len(now[1]) == 16
    assert list(report["versions_changed"]) == ["reward module rrrew"]
    x = v["sample"]
    assert x["id"] == int(first["id"][0]) and x["journaled"] == float(first["score"][0]) and x["rerun"] == x["journaled"] + 0.25
    text = render(report)
    assert "step 3: differs at scores" in text and f"reward module rrrew: {recorded} → {now[1]}" in text
    assert f"first sample scored otherwise: sample {x['id']}" in text


def test_rerun_keeps_the_reward_models_scores_unless_asked(tmp_path):
    from test_train_cli import save_tiny_hf

    save_tiny_hf(tmp_path / "rm", "cls")
    run = tmp_path / "run"
    out = train(run, "trainer.total_steps=2", f"model.reward_model.model_name_or_path={tmp_path / 'rm'}")
    assert out.returncode == 0, out.stderr[-2000:]
    kept = verlj("rerun", run, "--steps", "2:2")
    assert kept.returncode == 0, kept.stderr[-2000:]
    line = ("the reward model did not score the samples again (its journaled scores were kept): "
            "pass --rescore-model to re-score them (a forward pass per sample)")
    assert kept.stdout.splitlines().count(line) == 1
    again = verlj("rerun", run, "--steps", "2:2", "--rescore-model", "--json")
    assert again.returncode in (0, 1), again.stderr[-2000:]
    assert json.loads(again.stdout)["reward_model"] == "rescored" and line not in render(json.loads(again.stdout))
