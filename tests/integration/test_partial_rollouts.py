"""rollout.partial: generations that span weight updates, in async completion order, with real processes.
A long-tailed run trains with each token's version journaled (inspect, export); a SIGKILL of the trainer
after a push made the stopped generations durable, and of the generator alone mid-generation, then
--resume: every group asked arrived once, each generation durable at a kill went on from its durable
tokens (the same ids and log-probs, bit for bit, with their versions), none was asked again from its
start, and replay reproduces every fingerprint. Samples past rollout.max_token_staleness are dropped and
counted, none trained past it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_async_completion import check_accounting

from verlj.engine.loop.ledger import open_run
from verlj.engine.schema.events import DropReason, StepEvents
from verlj.engine.schema.sample import Columns, GroupProgress, token_versions
from verlj.journal import open_journal_reader
from verlj_testing import cli, fingerprints, replay_here, train

# the generator 10 ms a token: a push (every step, well under a second here) finds generations going, and a
# response of up to 24 tokens spans updates
SLOW = "generator.token:1:sleep-each=0.01"
PARTIAL = ["rollout.mode=async", "rollout.async_order=completion", "rollout.partial=true", "rollout.max_staleness=2",
           "rollout.max_response_length=24", "trainer.total_steps=6", "trainer.save_interval=3"]


def records(run: Path) -> dict:
    with open_journal_reader(run / "journal") as j:
        return {r.step: StepEvents.of(r) for r in j.iter_steps()}


def samples_by_group(steps: dict) -> dict[int, list]:
    out: dict[int, list] = {}
    for ev in steps.values():
        for s in Columns(ev.added.samples).samples():
            out.setdefault(s.group, []).append(s)
    return out


def durable(run: Path) -> dict[int, GroupProgress]:
    with open_run(run) as ledger:
        return ledger.in_flight.partial_groups()


def check_versions(steps: dict) -> int:
    """Every sample's runs cover its tokens, versions only go up along it, and none is newer than the step
    whose record holds it; returns the samples whose tokens came from more than one version."""
    spanning = 0
    for step, ev in steps.items():
        for s in Columns(ev.added.samples).samples():
            v = s.token_versions()
            assert len(s.version_runs) and len(v) == len(s.response_ids), (step, s.id)
            assert np.all(np.diff(v) >= 0) and v[0] == s.policy_version and v[-1] <= step, (step, s.id, v)
            spanning += v[-1] > v[0]
    return spanning


def test_a_long_tailed_partial_run_journals_each_tokens_version_and_replays(tmp_path):
    run = tmp_path / "run"
    out = train(run, *PARTIAL, VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = records(run)
    assert check_versions(steps) > 0  # generations went on across pushes
    metrics = {s: ev.values for s, ev in steps.items()}
    assert sum(m["rollout/partial/stopped_groups"] for m in metrics.values()) > 0
    assert all(m["rollout/partial/continued_groups"] == 0 and m["rollout/dropped_stale"] == 0 for m in metrics.values())  # no stop, no bound
    assert max(m["rollout/partial/later_version_tokens"] for m in metrics.values()) > 0
    assert all(0 <= m["rollout/token_staleness/mean"] <= m["rollout/token_staleness/max"] for m in metrics.values())
    # each version's tokens compared with the trainer's log-probs where the version is the one the step starts from
    assert all(m["rollout/logprob_diff/max"] < 1e-5 for m in metrics.values())
    acc = check_accounting(run)
    assert acc.regenerated == 0
    step = next(s for s, ev in steps.items() if any(len(x.version_runs) > 2 for x in Columns(ev.added.samples).samples()))
    shown = cli("inspect", run, "--step", str(step), check=True).stdout
    assert "partial rollouts" in shown and "tokens by version: v" in shown
    as_json = json.loads(cli("inspect", run, "--step", str(step), "--json", check=True).stdout)
    assert any(len(s.get("version_runs", ())) > 1 for s in as_json["samples"])
    exported = tmp_path / "rollouts.jsonl"
    cli("export", run, "--rollouts", "--format", "jsonl", "--output", exported, check=True)
    by_id = {s.id: s for ev in steps.values() for s in Columns(ev.added.samples).samples()}
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    assert len(rows) == len(by_id) and all(r["token_versions"] == by_id[r["sample_id"]].token_versions().tolist() for r in rows)
    assert replay_here(run, 6)[0]["fingerprint"] == fingerprints(run)[6]


def check_continued(steps: dict, phases: list[tuple[int, dict[int, GroupProgress]]]) -> int:
    """Each resume (after its last committed step, with the durable generations it read): every group it asked
    that had durable tokens for the same prompt went on from them (`continued`), none from its start; a
    group's samples begin with the durable tokens of the last resume that continued it (ids, log-probs bit
    for bit, their versions), which begin with those of any earlier one. Returns the groups continued."""
    history: dict[int, list[GroupProgress]] = {}
    for step, ev in steps.items():
        if ev.requests is None:
            continue
        read = [d for after, d in phases if after < step][-1:] or [{}]
        stops = read[0]
        asked = {int(g): int(r) for g, r in zip(ev.requests.groups, ev.requests.rows)}
        again = {int(g) for g in ev.requests.regenerated} | {g for g, r in asked.items() if g in stops and stops[g].row == r}
        continued = {int(g) for g in ev.requests.continued}
        assert {g for g in again if g in stops and stops[g].tokens} == continued, step  # none asked again from its start
        for g in continued:
            history.setdefault(g, []).append(stops[g])
    groups = samples_by_group(steps)
    last = max(steps)
    for g, states in history.items():
        if g not in groups:  # went on from its tokens and was still generating when the run ended
            assert any(g in ev.requests.groups for s, ev in steps.items() if ev.requests is not None and s >= last - 2), g
            continue
        got = sorted(groups[g], key=lambda s: s.id)
        for j, s in enumerate(got):
            for state in states:  # each resume's durable tokens, then what was generated after it: nothing twice
                n = len(state.responses[j])
                assert np.array_equal(s.response_ids[:n], state.responses[j]), (g, j)
                assert s.gen_logprobs[:n].tobytes() == state.logprobs[j].tobytes(), (g, j)
                assert np.array_equal(s.token_versions()[:n], token_versions(state.runs[j])), (g, j)
    return len(history)


def test_kills_mid_partial_generation_resume_from_the_durable_tokens_none_generated_twice(tmp_path):
    run = tmp_path / "run"
    out = train(run, *PARTIAL, VERLJ_FAILPOINT=f"{SLOW},partial.after_durable:3")  # after step 3's push made its stops durable
    assert out.returncode == -9, out.stderr[-3000:]
    kept = fingerprints(run)
    assert max(kept) == 2
    phases = [(max(kept), durable(run))]
    assert phases[0][1] and sum(g.tokens for g in phases[0][1].values()) > 0
    # the generator alone, SIGKILLed while it generates (as it sends its 6th group back): one line, and --resume goes on
    out = train(run, *PARTIAL, resume=True, VERLJ_FAILPOINT=f"{SLOW},generator.before_reply:6")
    assert out.returncode == 1 and "the rollout generator process (pid " in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    now = fingerprints(run)
    assert {s: now[s] for s in kept} == kept
    kept = now
    phases.append((max(kept), durable(run)))
    out = train(run, *PARTIAL, resume=True, VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    now = fingerprints(run)
    assert {s: now[s] for s in kept} == kept
    steps = records(run)
    check_versions(steps)
    check_accounting(run)  # every group asked arrived once; every sample trained or dropped once at most
    assert check_continued(steps, phases) > 0
    resumed = [ev for ev in steps.values() if ev.requests is not None and len(ev.requests.continued)]
    assert all(ev.values["rollout/partial/continued_tokens"] > 0 for ev in resumed)
    assert replay_here(run, 6)[0]["fingerprint"] == fingerprints(run)[6]
    first = min(s for s, ev in steps.items() if ev.requests is not None and len(ev.requests.continued))
    req = steps[first].requests
    again, went_on = set(req.regenerated.tolist()), set(req.continued.tolist())
    # a group asked again that went on from its durable tokens is counted once, by how (groups a push in this process
    # stopped go on from their tokens too: they were not asked again)
    assert again & went_on
    shown = cli("inspect", run, "--step", str(first), check=True).stdout
    how = ", ".join(f"{n} {what}" for n, what in ((len(again - went_on), "from their seeds"), (len(again & went_on), "from their durable tokens")) if n)
    assert f"; asked again {len(again)} groups in flight when the last process stopped: {how}\n" in shown, shown


def test_two_ranks_resume_every_ranks_durable_generations(tmp_path):
    """Each rank's generator stops its own groups at a push; rank 0 makes every rank's durable; after a kill
    every rank reads them and asks its own share from its durable tokens, and the record names them all."""
    run = tmp_path / "run"
    over = [*PARTIAL, "distributed.zero_stage=2", "trainer.total_steps=4", "trainer.save_interval=2"]
    out = train(run, *over, ranks=2, VERLJ_FAILPOINT=f"{SLOW},partial.after_durable:2")
    assert out.returncode != 0, out.stderr[-3000:]
    assert max(fingerprints(run)) == 1
    stops = durable(run)
    assert len(stops) > 1
    out = train(run, *over, ranks=2, resume=True, VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = records(run)
    check_versions(steps)
    check_accounting(run)
    assert check_continued(steps, [(1, stops)]) > 1


def test_no_sample_past_the_token_staleness_bound_is_trained_and_every_drop_is_counted(tmp_path):
    """Dynamic sampling leaves groups waiting (the drop itself, by the oldest token: test_partial's
    resumed-source test); whatever the timing, none is trained past the bound and the metric counts the drops."""
    run = tmp_path / "run"
    bound = 2
    out = train(run, *PARTIAL, f"rollout.max_token_staleness={bound}", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
                "trainer.total_steps=8", VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = records(run)
    stale = sum(len(ev.dropped(DropReason.STALE)) for ev in steps.values())
    assert sum(ev.values["rollout/dropped_stale"] for ev in steps.values()) == stale
    by_id = {s.id: s for ev in steps.values() for s in Columns(ev.added.samples).samples()}
    for step, ev in steps.items():
        assert all(step - 1 - by_id[int(i)].policy_version <= bound for i in ev.consumed.ids), step
        assert all(step - 1 - by_id[int(i)].policy_version > bound for i in ev.dropped(DropReason.STALE)), step
        assert ev.values["rollout/token_staleness/max"] <= bound
    check_accounting(run)


def test_vllm_partial_rollouts_resume_from_the_durable_tokens(tmp_path):
    if os.environ.get("CI"):
        import vllm  # noqa: F401 - in CI a missing vLLM is a failure, not a skip
    else:
        pytest.importorskip("vllm")
    run = tmp_path / "run"
    over = [*PARTIAL, "rollout.engine=vllm", "model.tiny.num_heads=2"]
    out = train(run, *over, VERLJ_FAILPOINT=f"{SLOW},partial.after_durable:3")
    assert out.returncode == -9, out.stderr[-3000:]
    assert max(fingerprints(run)) == 2
    stops = durable(run)
    assert stops
    out = train(run, *over, resume=True, VERLJ_FAILPOINT=SLOW)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = records(run)
    assert check_versions(steps) > 0
    check_accounting(run)
    assert check_continued(steps, [(2, stops)]) > 0  # a continued request keeps its durable tokens
    assert replay_here(run, 6)[0]["fingerprint"] == fingerprints(run)[6]
