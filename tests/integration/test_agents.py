"""Agent programs as rollouts (rollout.agent) in real training runs: an agent written against the `openai`
client trains on its rewards, every call journaled with the sample; SIGKILLed in sync mode then resumed
it is bit-identical to the uninterrupted run; replay never runs an agent; an async streaming agent scored
by rollout.reward_fn; an agent that raises is an episode fault, counted and never trained on. In completion
order, killed mid-episode and resumed, the journaled calls are answered from the journal (none generated
twice) and a changed agent diverges; in async step order a kill resumes bit-identical."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from verlj.engine.schema.events import DropReason, StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import TINY, assert_same_journal, cli, fingerprints, kill_and_resume, raised_at, replay_here, train, verlj

TESTS = str(Path(__file__).resolve().parents[1])  # agents_for_tests
AGENT = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:digits", "rollout.max_turns=2", "trainer.total_steps=4",
         "trainer.save_interval=2"]


def steps_of(run: Path) -> dict[int, StepEvents]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: StepEvents.of(rec) for rec in j.iter_steps()}


@pytest.fixture(scope="module")
def agent_ref(tmp_path_factory, reference_run):
    """The agent's run (test_distill_runs's agent_run, trained once)."""
    return reference_run(tmp_path_factory.mktemp("agent") / "ref", [*TINY, *AGENT], {"PYTHONPATH": TESTS})


def test_an_openai_agent_trains_on_its_rewards_and_every_call_is_journaled(agent_ref):
    steps = steps_of(agent_ref)
    assert sorted(steps) == [1, 2, 3, 4]
    for st in steps.values():
        samples = unpack(st.added.samples)
        assert len(samples) == 16 and all(s.agent_calls for s in samples)
        assert st.metrics.values["agent/calls"] == 32.0
        for s in samples:
            led = json.loads(s.agent_calls)
            # the agent returned; its sample ended by length exactly when its last answer was cut there (the tiny
            # model rarely stops before its 4 tokens), and the step's rollout/truncated counts those
            cut = json.loads(led["calls"][-1]["response"])["choices"][0]["finish_reason"] == "length"
            assert s.env_end == (EnvEnd.LENGTH if cut else EnvEnd.DONE)
            assert led["v"] == 2 and len(led["calls"]) == 2 and s.rule_reward == led["reward"]
            # the second call continues the first as answered: spliced, one chain, both trained
            assert led["trained"] == [0, 1] and led["segments"] == 1
            first, second = led["calls"]
            # the sample's tokens are the calls' ids, never re-tokenized text: the first prompt, then the completions at
            # the policy's places in the mask, the whole the second call's prompt and completion
            assert s.prompt_ids.tolist() == first["prompt_ids"]
            assert s.prompt_ids.tolist() + s.response_ids.tolist() == second["prompt_ids"] + second["completion_ids"]
            policy = s.response_ids[s.loss_mask == 1].tolist()
            assert policy == first["completion_ids"] + second["completion_ids"]
            body = json.loads(led["calls"][0]["response"])
            assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(led["calls"][0]["prompt_ids"])
        assert st.metrics.values["agent/truncated"] == sum(s.env_end == EnvEnd.LENGTH for s in samples)
    scores = [s.score for st in steps.values() for s in unpack(st.added.samples)]
    assert len(set(scores)) > 1  # the rewards vary: the update has something to learn from
    shown = cli("inspect", agent_ref, "--step", "2", check=True).stdout
    assert shown.count("         call 1") == 16 and shown.count("'user: more' → ") == 16 and "(not trained" not in shown
    # each sample on one line of the table though its chat prompt spans several (line breaks written as \\n)
    table = shown.split("(id group version | prompt → response | score)\n")[1].split("\nmetrics")[0].splitlines()
    rows = [line for line in table if not line.startswith("         ")]
    assert len(rows) == 16 and all(re.fullmatch(r" +\d+ +\d+ v\d+ +\| <\|user\|>\\n.* → .* \| \S+( consumed| dropped)?", r) for r in rows), rows[:3]
    detail = json.loads(cli("inspect", agent_ref, "--step", "2", "--json", check=True).stdout)
    assert any(len(s.get("calls", [])) == 2 for s in detail["samples"])
    counts = json.loads(cli("inspect", agent_ref, "--json", check=True).stdout)["agents"]
    assert sum(int(st.metrics.values["agent/prefix_breaks"]) for st in steps.values()) == 0
    assert counts == {"calls_generated": 128, "calls_from_journal": 0, "divergences": 0, "prefix_breaks": 0,
                      "malformed_tool_calls": 0, "faults": 0, "unresolved": 0,
                      "truncated": sum(s.env_end == EnvEnd.LENGTH for st in steps.values() for s in unpack(st.added.samples))}


def test_killed_mid_step_then_resumed_is_bit_identical_and_replay_runs_no_agent(tmp_path, agent_ref):
    run = tmp_path / "run"
    out = train(run, *AGENT, PYTHONPATH=TESTS, VERLJ_FAILPOINT="step.before_commit:3")  # step 3's agents ran; nothing of it committed
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *AGENT, resume=True, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(run) == fingerprints(agent_ref)
    assert_same_journal(run, agent_ref)
    import os

    os.environ["VERLJ_TEST_AGENT_FORBID"] = "1"  # any agent run would end this process (exit 97)
    try:
        report, line = replay_here(run, 4)
    finally:
        del os.environ["VERLJ_TEST_AGENT_FORBID"]
    assert line == "" and report


def test_an_async_streaming_agent_is_scored_by_the_reward_fn_and_a_raising_one_is_a_fault(tmp_path):
    run = tmp_path / "stream"
    out = train(run, "model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:streaming", "trainer.total_steps=1", PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    samples = unpack(steps_of(run)[1].added.samples)
    assert all(json.loads(s.agent_calls)["calls"][0]["response"].endswith("data: [DONE]\n\n") for s in samples)
    assert all(json.loads(s.agent_calls)["reward"] is None for s in samples)  # rollout.reward_fn (auto: builtin:add) scored them
    # token by token (hf, sync): a delta a token, here a character each (the ascii vocabulary), as the stream sent them
    deltas = [[json.loads(e[6:])["choices"][0]["delta"].get("content") for e in json.loads(s.agent_calls)["calls"][0]["response"].split("\n\n")
               if e.startswith("data: {") and json.loads(e[6:])["choices"]] for s in samples]
    texts = [[d for d in ds if d] for ds in deltas]
    assert any(len(t) > 1 for t in texts) and all(len(d) == 1 for t in texts for d in t)
    run = tmp_path / "flaky"
    out = train(run, "model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:flaky", "rollout.max_turns=2", "trainer.total_steps=2",
                "rollout.max_fault_rate=1", PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = steps_of(run)
    faulted = [s for st in steps.values() for s in unpack(st.added.samples) if s.env_end == EnvEnd.FAULT]
    said = "the agent raised RuntimeError: the sandbox is down" + raised_at(Path(TESTS) / "agents_for_tests.py", 'raise RuntimeError("the sandbox is down")')
    assert faulted and all(s.env_reason == said for s in faulted)
    dropped = {int(i) for st in steps.values() for i in st.dropped(DropReason.FAULT)}
    assert {s.id for s in faulted} <= dropped
    assert all(not set(st.consumed.ids.tolist()) & dropped for st in steps.values())
    assert "faults " in out.stdout and "the sandbox is down" in out.stdout


COMPLETION = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:digits", "rollout.max_turns=2", "trainer.total_steps=2",
              "rollout.mode=async", "rollout.async_order=completion"]


@pytest.fixture(scope="module")
def completion_ref(tmp_path_factory):
    run = tmp_path_factory.mktemp("agent_completion") / "ref"
    out = train(run, *COMPLETION, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def agents_of(run: Path) -> dict:
    return json.loads(cli("inspect", run, "--json", check=True).stdout)["agents"]


def test_completion_order_killed_mid_episode_answers_the_journaled_calls_from_the_journal(tmp_path, completion_ref):
    """Killed after step 2's third durable write (8 episodes past both calls, 8 past their first), resumed: every
    journaled call answered from the journal, none generated twice, the same samples as the uninterrupted run."""
    ref = agents_of(completion_ref)
    assert ref["calls_from_journal"] == 0 and ref["divergences"] == 0
    run = tmp_path / "run"
    out = train(run, *COMPLETION, PYTHONPATH=TESTS, VERLJ_FAILPOINT="agents.after_durable:11")
    assert out.returncode == -9, out.stderr[-3000:]
    assert fingerprints(run) == {1: fingerprints(completion_ref)[1]}  # step 1 committed; step 2's round in flight
    out = train(run, *COMPLETION, resume=True, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    got = agents_of(run)
    assert got["calls_from_journal"] == 24 and got["divergences"] == 0, got
    assert got["calls_generated"] + got["calls_from_journal"] == ref["calls_generated"]  # no completed call generated twice
    assert_same_journal(run, completion_ref, ignore=("agent/calls", "agent/durable_writes"))
    assert fingerprints(run) == fingerprints(completion_ref)


def test_completion_order_an_agent_changed_before_the_resume_diverges_and_goes_on_live(tmp_path, completion_ref):
    """The resumed agent sends another second message: each journaled second call is a divergence (one line each),
    discarded, generated live; the first calls still come from the journal."""
    run = tmp_path / "run"
    out = train(run, *COMPLETION, PYTHONPATH=TESTS, VERLJ_FAILPOINT="agents.after_durable:11")
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *COMPLETION, resume=True, PYTHONPATH=TESTS, VERLJ_TEST_AGENT_MORE="more please")
    assert out.returncode == 0, out.stderr[-3000:]
    got = agents_of(run)
    assert got["divergences"] == 8 and got["calls_from_journal"] == 16, got
    lines = [ln for ln in out.stderr.splitlines() if "diverged" in ln]
    assert len(lines) == 8 and all("at call 1" in ln and "messages[2]" in ln and "of group" in ln for ln in lines), lines
    resumed = unpack(steps_of(run)[2].added.samples)  # step 2's groups: all played by the resumed process
    assert len(resumed) == len(unpack(steps_of(completion_ref)[2].added.samples))
    for s in resumed:  # each episode's second call is the changed agent's: the journaled one it replaced is in no sample
        last = [json.loads(c["request"])["messages"][-1]["content"] for c in json.loads(s.agent_calls)["calls"]]
        assert len(last) == 2 and last[1] == "more please", last


def test_async_step_order_trains_and_a_kill_mid_step_resumes_bit_identical(tmp_path):
    """Async step order: the batch of step s+1 played while step s updates (the agents seen running during the
    update), from version s-1; killed before a commit, resumed: the same journal and fingerprints as the
    uninterrupted run."""
    planned = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:overlapping", "rollout.max_turns=2", "trainer.total_steps=3",
               "rollout.mode=async", "rollout.async_order=step"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    seen = tmp_path / "overlap"
    out = train(ref, *planned, PYTHONPATH=TESTS, VERLJ_TEST_AGENT_OVERLAP=str(seen))
    assert out.returncode == 0, out.stderr[-3000:]
    assert seen.exists() and seen.read_text().strip()  # some agent ran while the trainer's main thread was in its update
    steps = steps_of(ref)
    assert all(len(json.loads(s.agent_calls)["calls"]) == 2 for st in steps.values() for s in unpack(st.added.samples))
    assert [int(st.metrics.values["agent/calls"]) for st in steps.values()] == [64, 32, 32]  # step 1 plays batches 1 and 2
    kill_and_resume(run, ref, *planned, failpoint="step.before_commit:2", PYTHONPATH=TESTS, VERLJ_TEST_AGENT_OVERLAP=str(seen))


def test_on_vllm_an_agent_trains_and_a_kill_mid_step_resumes_bit_identical(tmp_path):
    """rollout.engine=vllm: the engine is sized to a call's whole conversation (the chat template and the
    tools make a prompt longer than data.max_prompt_length; it was sized to that and refused the calls)."""
    over = [*AGENT, "rollout.engine=vllm", "trainer.total_steps=3"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(st.rollout.engine == "vllm" and st.metrics.values["agent/calls"] == 32.0 for st in steps_of(ref).values())
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:2", PYTHONPATH=TESTS)
    assert len(fingerprints(ref)) == 3


TWO_RANKS = {"sync": ([], "step.before_commit:2"),
             "step": (["rollout.mode=async", "rollout.async_order=step"], "step.before_commit:2"),
             "completion": (["rollout.mode=async", "rollout.async_order=completion"], "agents.after_durable:45")}


@pytest.mark.parametrize("order", list(TWO_RANKS))
def test_on_two_ranks_killed_then_resumed_is_bit_identical(tmp_path, order):
    """torchrun, 2 ranks: each serves its own gateway and plays its share of the episodes (agents of one to three
    calls, one at a time: a rank's batches are its calls, and the rank done first generates with the other); the
    step's agent/calls count both ranks'. SIGKILLed (completion order: mid-episode, step 2's calls durable) then resumed:
    the journal and fingerprints of the uninterrupted 2-rank run (completion order: the journaled calls answered
    from the journal)."""
    over = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:uneven", "rollout.max_turns=3", "rollout.agent_concurrency=1",
            "trainer.total_steps=3", *TWO_RANKS[order][0]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over, ranks=2, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    uneven = False
    for st in steps_of(ref).values():
        calls = [len(json.loads(s.agent_calls)["calls"]) for s in unpack(st.added.samples)]  # rank 0's first
        assert set(calls) == {1, 2, 3} and st.metrics.values["agent/calls"] == sum(calls)
        uneven |= sum(calls[:8]) != sum(calls[8:16])
    assert uneven  # some batch was generated with a rank that had no call waiting
    out = train(run, *over, ranks=2, PYTHONPATH=TESTS, VERLJ_FAILPOINT=TWO_RANKS[order][1])
    assert out.returncode != 0 and fingerprints(run) == {1: fingerprints(ref)[1]}, out.stderr[-3000:]
    out = train(run, *over, ranks=2, resume=True, PYTHONPATH=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(run) == fingerprints(ref)
    if order == "completion":
        got = agents_of(run)
        assert got["calls_from_journal"] > 0 and got["divergences"] == 0, got
        assert got["calls_generated"] + got["calls_from_journal"] == agents_of(ref)["calls_generated"]
    assert_same_journal(run, ref, ignore=("agent/calls", "agent/durable_writes"))


def test_the_fault_stop_s_advice_run_as_printed_trains_the_intended_job(tmp_path):
    """Step 1 of a fresh run stopped by its faults keeps nothing: the advice is the command itself (never `--resume`,
    which would start the built-in default job in a directory that is gone), pasted as printed it trains the agent
    run it names, past the faults or once they are fixed. A run that was there before and never committed a step
    is kept as it is, so the `--resume` the advice names there starts it with its own config."""
    import shlex

    code = tmp_path / "code"
    code.mkdir()
    broken = "def solve(ep):\n    raise RuntimeError('the sandbox is down')\n"
    fixed = ("import openai\ndef solve(ep):\n    c = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)\n"
             "    c.chat.completions.create(model=ep.model, messages=[{'role': 'user', 'content': ep.row['prompt']}])\n    return 1.0\n")
    (code / "fixme.py").write_text(broken)
    over = ["model.tiny.vocab=ascii", "rollout.agent=fixme:solve", "trainer.total_steps=2", "trainer.save_interval=2"]

    def advice(out) -> list[list[str]]:
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        return [shlex.split(c) for c in re.findall(r"`([^`]+)`", errors[0])]

    def run_as_printed(words: list[str]):
        assert words[:2] == ["verlj", "train"], words
        return verlj(*words[1:], PYTHONPATH=code)

    def agent_of(run: Path) -> str:
        from verlj.engine.loop.ledger import Ledger

        with Ledger.open_reader(run) as ledger:
            return ledger.config_at(ledger.last_step())["rollout"]["agent"]

    for past_the_faults in (True, False):
        run = tmp_path / f"r{int(past_the_faults)}"
        (code / "fixme.py").write_text(broken)
        printed = advice(train(run, *over, PYTHONPATH=code))
        assert not run.exists() and len(printed) == 3 and "--resume" not in printed[0] + printed[1], printed
        assert printed[1] == [*printed[0], "rollout.max_fault_rate=1"] and printed[2] == ["verlj", "inspect", str(run), "--step", "1"]
        if not past_the_faults:
            (code / "fixme.py").write_text(fixed)
        out = run_as_printed(printed[1] if past_the_faults else printed[0])
        assert out.returncode == 0, out.stderr[-3000:]
        assert agent_of(run) == "fixme:solve" and sorted(fingerprints(run)) == [1, 2]
        shown = cli(*printed[2][1:], check=True).stdout
        assert ("ended by a fault: the agent raised RuntimeError: the sandbox is down" in shown) == past_the_faults, shown

    # a run killed before its first step is there to resume: a failed start leaves it so, and its --resume is the advice
    run = tmp_path / "empty"
    (code / "fixme.py").write_text(fixed)
    assert train(run, *over, PYTHONPATH=code, VERLJ_FAILPOINT="step.before_commit:1").returncode == -9
    (code / "fixme.py").write_text(broken)
    printed = advice(verlj("train", "--output-dir", run, "--resume", PYTHONPATH=code))
    assert printed[0] == ["verlj", "train", "--output-dir", str(run), "--resume"], printed
    (code / "fixme.py").write_text(fixed)
    out = run_as_printed(printed[0])
    assert out.returncode == 0 and "never committed a step; starting it afresh with its stored config" in out.stdout, out.stderr[-3000:]
    assert agent_of(run) == "fixme:solve" and sorted(fingerprints(run)) == [1, 2]
