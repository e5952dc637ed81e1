"""Agents on a real tokenizer (the bpe_model fixture: a Qwen2 with a byte-level BPE and a ChatML template that speaks
tools): an openai-client agent with tools, the OpenAI Agents SDK on its default model (the Responses API) and a
streaming async agent that never closes its client. Each trains with no prefix break (every call that continues
its conversation as answered is spliced onto it) and no traceback in the log; killed before a commit in sync mode
and resumed, bit-identical; killed mid-episode in completion order and resumed, its journaled calls answered from
the journal, none generated twice, the same samples as the uninterrupted run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import unpack
from verlj.journal import open_journal_reader
from verlj_testing import assert_same_journal, cli, fingerprints, kill_and_resume, train

TESTS = str(Path(__file__).resolve().parents[1])
AGENTS = {
    "openai_tools": ["rollout.agent=agents_for_tests:tooled", "rollout.max_turns=3"],
    "sdk_responses": ["rollout.agent=examples.agents_sdk:solve", "rollout.max_turns=3"],
    "async_stream": ["rollout.agent=agents_for_tests:leaky_stream", "rollout.max_turns=2"],
}
NOISE = ("Traceback", "Event loop is closed", "Task exception was never retrieved")


def overrides(bpe_model: str, agent: str, *more: str) -> list[str]:
    return [f"model.actor.model_name_or_path={bpe_model}", *AGENTS[agent], "rollout.max_response_length=48", "trainer.total_steps=3",
            "trainer.save_interval=1", "rollout.max_fault_rate=1", *more]


def samples_of(run: Path) -> list:
    with open_journal_reader(run / "journal") as j:
        return [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]


def agents_of(run: Path) -> dict:
    return json.loads(cli("inspect", run, "--json", check=True).stdout)["agents"]


def check_clean(out, run: Path, agent: str, episodes: int | None = 48) -> None:
    """No prefix break, calls that continue (so spliced), no traceback; a streaming agent's own lines tagged, once."""
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert not any(n in said for n in NOISE), said[-3000:]
    got = agents_of(run)
    assert got["prefix_breaks"] == 0 and got["calls_generated"] + got["calls_from_journal"] > 16 * 3, got
    chains = [json.loads(s.agent_calls)["trained"] for s in samples_of(run) if s.agent_calls]
    assert any(len(c) >= 2 for c in chains)  # episodes whose later calls were spliced onto their first
    if agent == "async_stream":
        lines = re.findall(r"\[episode (\d+)\] leaky_stream: episode (\d+) played, attempt (\d+)", said)
        assert len(lines) == len(set(lines)) and all(a == b for a, b, _ in lines)  # each episode's line once, tagged
        assert episodes is None or len(lines) == episodes


@pytest.mark.parametrize("agent", ["openai_tools", "async_stream"])  # the Agents SDK's: tests/integration/test_agents_sdk.py
def test_on_a_real_tokenizer_an_agent_trains_with_no_prefix_break_and_a_kill_resumes_bit_identical(tmp_path, bpe_model, agent):
    ref, run = tmp_path / "ref", tmp_path / "run"
    over = overrides(bpe_model, agent)
    out = train(ref, *over, PYTHONPATH=TESTS)
    check_clean(out, ref, agent)
    if agent == "openai_tools":  # the model writes tool calls that parse: their results went back, spliced
        assert any(json.loads(s.agent_calls)["calls"][0]["response"].count('"tool_calls"') for s in samples_of(ref))
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:2", PYTHONPATH=TESTS)


@pytest.mark.parametrize("agent", list(AGENTS))
def test_on_a_real_tokenizer_completion_order_answers_the_journaled_calls_from_the_journal(tmp_path, bpe_model, agent):
    """Killed at step 2's second durable write (calls of its episodes journaled, the step not committed), resumed: those
    calls answered from the journal byte for byte, none generated twice, no divergence, no break, and the journal and
    fingerprints of the uninterrupted run."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    over = overrides(bpe_model, agent, "rollout.mode=async", "rollout.async_order=completion")
    out = train(ref, *over, PYTHONPATH=TESTS)
    check_clean(out, ref, agent, None)
    with open_journal_reader(ref / "journal") as j:
        writes = [int(StepEvents.of(rec).metrics.values["agent/durable_writes"]) for rec in j.iter_steps()]
    assert writes[1] >= 2, writes
    out = train(run, *over, PYTHONPATH=TESTS, VERLJ_FAILPOINT=f"agents.after_durable:{writes[0] + 2}")
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True, PYTHONPATH=TESTS)
    check_clean(out, run, agent, None)
    got, want = agents_of(run), agents_of(ref)
    assert got["calls_from_journal"] > 0 and got["divergences"] == 0, got
    assert got["calls_generated"] + got["calls_from_journal"] == want["calls_generated"]  # no completed call generated twice
    assert_same_journal(run, ref, ignore=("agent/calls", "agent/durable_writes"))
    assert fingerprints(run) == fingerprints(ref)


def test_on_a_real_tokenizer_async_step_order_trains_with_no_prefix_break(tmp_path, bpe_model):
    run = tmp_path / "run"
    out = train(run, *overrides(bpe_model, "openai_tools", "rollout.mode=async", "rollout.async_order=step"), PYTHONPATH=TESTS)
    check_clean(out, run, "openai_tools")
