"""Faults in plain single-turn runs (rl.faults): a reward function that raises or returns NaN on some samples
has those samples counted, journaled with their reasons and never trained on; the step's log line says so.
(Episodes' faults, the stop past rollout.max_fault_rate and the resume after it: test_episodes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from verlj.engine.schema.events import DropReason, StepEvents
from verlj.engine.schema.sample import unpack
from verlj.journal import open_journal_reader
from verlj_testing import cli, fingerprints, raised_at, train, verlj

TESTS = str(Path(__file__).resolve().parents[1])


def test_a_reward_function_that_fails_on_some_samples_leaves_them_out(tmp_path):
    run = tmp_path / "run"
    out = train(run, "rollout.reward_fn=envs_for_tests:flaky_reward", "rollout.max_fault_rate=1", "trainer.total_steps=3",
                "trainer.save_interval=10",
                PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    reasons, faulted = set(), {}
    with open_journal_reader(run / "journal") as j:
        for rec in j.iter_steps():
            e = StepEvents.of(rec)
            samples = unpack(e.added.samples)
            bad = [s for s in samples if s.fault]
            reasons |= {s.fault for s in bad}
            faulted[rec.step] = bad
            assert all(s.rule_reward == 0.0 and not s.is_episode for s in bad)
            assert {s.id for s in bad} <= set(e.dropped(DropReason.FAULT).tolist())
            assert not set(e.dropped(DropReason.FAULT).tolist()) & set(e.consumed.ids.tolist())
            m = e.metrics.values
            assert m["rollout/faults"] == m["rollout/faults/reward"] == float(len(bad)) and m["rollout/faults/env"] == 0.0
            line = next(x for x in out.stdout.splitlines() if x.startswith(f"[INFO] Step {rec.step}: "))
            if bad:  # single-turn samples: the line names faults where there are some
                assert line.endswith(f"faults {len(bad)}/{len(samples)}: {min(bad, key=lambda s: s.id).fault}"), line
            else:
                assert " faults " not in line, line
    at = raised_at(Path(TESTS) / "envs_for_tests.py", 'raise RuntimeError("the grader is down")')  # where in the user's function
    assert reasons == {"reward function envs_for_tests.flaky_reward raised RuntimeError: the grader is down" + at,
                       "reward function envs_for_tests.flaky_reward returned nan, not a finite number"}
    step = next(s for s, bad in faulted.items() if bad)  # inspect shows each sample's fault, and that it was dropped
    shown = cli("inspect", run, "--step", str(step), "--max-samples", "1000", check=True).stdout
    assert f"a fault, never trained on: {faulted[step][0].fault}" in shown
    assert all(f"| {s.score:.4g} dropped" in shown for s in faulted[step])
    cli("export", run, "--rollouts", "-o", tmp_path / "rows.jsonl", check=True)  # each sample's fault a column, with its fate
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {(r["step"], r["sample_id"]): r["fault"] for r in rows if r["fault"]} == {(k, s.id): s.fault for k, bad in faulted.items() for s in bad}
    assert all(r["status"] == "dropped" for r in rows if r["fault"])
    n = sum(len(bad) for bad in faulted.values())  # verify counts them by kind, not as damage
    said = cli("verify", run, check=True).stdout
    assert f"· {n} samples ended by a fault, none trained: 0 by their env or agent, {n} by their reward function, 0 unresolved" in said
    rep = verlj("replay", run, "--to-step", "2", PYTHONPATH=TESTS)  # from the initial state: the drops read back
    assert rep.returncode == 0 and fingerprints(run)[2] in rep.stdout, rep.stderr[-3000:]
