"""LangChain with MCP tools, unmodified, trains through episode.mcp_url on the BPE test model: examples/langchain_mcp.py,
a `cmd:` agent in an interpreter of its own (LangChain's MCP adapters pin mcp<2; verlj's tools server is mcp 2's), lists
rollout.tools through MultiServerMCPClient, offers them to the policy through ChatOpenAI, and sends each tool call the
policy makes through the same client: journaled with its key, an external one applied once. tools/extras.py makes that
interpreter's venv and runs this module with VERLJ_TESTS_AGENT_PYTHON naming its python (harness.AGENT_SIDE)."""

from __future__ import annotations

import json
import os

from test_tools import trained

from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import REPO, cli, fingerprints, train

TOOLS = "rollout.tools=[examples.agents_sdk_mcp:add,examples.agents_sdk_mcp:submit]"


def test_a_langchain_agent_lists_verljs_tools_over_mcp_trains_and_a_kill_resumes_bit_identical(tmp_path, bpe_model):
    agent = f"rollout.agent=cmd:{os.environ['VERLJ_TESTS_AGENT_PYTHON']} {REPO / 'examples' / 'langchain_mcp.py'}"
    over = [agent, TOOLS, "rollout.max_turns=3", "rollout.max_response_length=48", "rollout.overlong=reward", "trainer.total_steps=2",
            "data.prompts_per_step=4", f"model.actor.model_name_or_path={bpe_model}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over, VERLJ_SUBMISSIONS=str(tmp_path / "ref.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(ref / "journal") as j:
        samples = [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]
    assert samples and all(s.env_end in (EnvEnd.DONE, EnvEnd.LENGTH) for s in samples)  # no fault, none unresolved
    for s in samples:
        led = json.loads(s.agent_calls)
        req = json.loads(led["calls"][0]["request"])  # LangChain's own chat request (no "api": chat is the default): the tools its adapter listed
        assert "api" not in req and sorted(t["function"]["name"] for t in req["tools"]) == ["add", "submit"], req
        for k, t in enumerate(led.get("tools", [])):
            assert t["state"] == "done" and t["key"].endswith(f"-e{s.id}-t{k}")
    sent = (tmp_path / "ref.jsonl").read_text().splitlines() if (tmp_path / "ref.jsonl").exists() else []
    assert len(sent) == sum(t["name"] == "submit" for s in samples for t in json.loads(s.agent_calls).get("tools", []))

    out = train(run, *over, VERLJ_SUBMISSIONS=str(tmp_path / "run.jsonl"), VERLJ_FAILPOINT="tools.after_done:2")  # mid-step
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True, VERLJ_SUBMISSIONS=str(tmp_path / "run.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    # the samples trained are the uninterrupted run's, token for token; their tool calls differ only in whose run they were (the key)
    mine, theirs = trained(run), trained(ref)
    assert [t[:-1] for t in mine] == [t[:-1] for t in theirs]
    assert [[(c["name"], c["arguments"], c["result"]) for c in t[-1]] for t in mine] == [[(c["name"], c["arguments"], c["result"]) for c in t[-1]] for t in theirs]
    with open_journal_reader(run / "journal") as j:  # the calls made durable before the kill answered from the journal, not sent
        assert sum(StepEvents.of(r).metrics.values["agent/tool_calls_from_journal"] for r in j.iter_steps()) >= 1
    sent = [json.loads(x)["key"] for x in (tmp_path / "run.jsonl").read_text().splitlines()] if (tmp_path / "run.jsonl").exists() else []
    assert len(sent) == len(set(sent))  # an external submission never sent twice
    assert fingerprints(run) == fingerprints(ref) and cli("verify", run).returncode == 0
