"""An OpenAI Agents SDK agent (examples/agents_sdk.py: the library used unmodified, on its default model, the Responses
API) trained by verlj on the bpe_model: every call the SDK makes journaled with its sample, its requests the SDK's own,
the reward scored from its final output, a row per call exported; SIGKILLed before a commit in sync mode and resumed,
bit-identical to the uninterrupted run."""

from __future__ import annotations

import json

from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import cli, kill_and_resume, train

SDK = ["rollout.agent=examples.agents_sdk:solve", "rollout.max_turns=3", "rollout.max_response_length=48",
       "trainer.total_steps=2", "trainer.save_interval=1"]


def test_an_agents_sdk_agent_trains_on_its_rewards_and_a_kill_resumes_bit_identical(tmp_path, bpe_model):
    ref = tmp_path / "ref"
    over = [*SDK, f"model.actor.model_name_or_path={bpe_model}"]
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(ref / "journal") as j:
        samples = [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]
    assert len(samples) == 32 and all(s.env_end in (EnvEnd.DONE, EnvEnd.LENGTH) and s.agent_calls for s in samples)
    for s in samples:
        led = json.loads(s.agent_calls)
        assert 1 <= len(led["calls"]) <= 3
        if s.env_end == EnvEnd.LENGTH:  # the SDK raised on a response cut at its length: truncated, scored 0 (the yaml's overlong)
            assert led["reward"] is None and s.score == 0.0 and "ModelBehaviorError" in s.env_reason, s.env_reason
            continue
        assert s.rule_reward == led["reward"]
        req = json.loads(led["calls"][0]["request"])  # the SDK's request, as it sent it (the Responses API)
        assert req["api"] == "responses" and req["instructions"].startswith("Answer with the number")
        assert req["tools"][0]["function"]["strict"] is True
        last = json.loads(led["calls"][-1]["response"])
        final = "".join(p["text"] for item in last["output"] if item["type"] == "message" for p in item["content"])
        # scored from the SDK's final output: the row's answer in it, else a tenth of its share of digits; an episode the
        # SDK ended for more than max_turns calls scores 0
        assert led["reward"] in (1.0, 0.0, 0.1 * sum(c.isdigit() for c in final) / max(1, len(final)))
    assert len({s.rule_reward for s in samples}) > 1  # the rewards vary: the update has something to learn from
    assert json.loads(cli("inspect", ref, "--json", check=True).stdout)["agents"]["prefix_breaks"] == 0
    out = cli("export", ref, "--rollouts", "--turns", "-o", tmp_path / "calls.jsonl", check=True)  # a row per model call
    rows = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert f"wrote {len(rows)} calls to" in out.stdout
    want = [(s.id, k + 1, c["completion_ids"]) for s in samples for k, c in enumerate(json.loads(s.agent_calls)["calls"])]
    assert [(r["sample_id"], r["call"], r["completion_ids"]) for r in rows] == want
    assert all(json.loads(r["messages"])[0]["role"] == "system" and r["status"] == "consumed" for r in rows)
    check_trl_trains_the_assistant_turns(ref, bpe_model, tmp_path)
    kill_and_resume(tmp_path / "run", ref, *over, failpoint="step.before_commit:2")


def check_trl_trains_the_assistant_turns(run, bpe_model: str, tmp_path) -> None:
    """The datasets guide's way to train the exported conversations on the model's own template: TRL's SFTTrainer with
    assistant_only_loss=True, which needs the template's {% generation %} marks (the BPE model's has them). One step,
    its loss finite and the weights moved; the assistant tokens' mask is what the model wrote, tool calls included."""
    import math

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cli("export", run, "--sft", "--format", "jsonl", "-o", tmp_path / "sft", check=True)
    rows = datasets.load_dataset("json", data_files=str(tmp_path / "sft" / "data" / "train-*"), split="train")
    tok = AutoTokenizer.from_pretrained(bpe_model)
    first = rows[0]
    got = tok.apply_chat_template(first["messages"], tools=json.loads(first["tools"]) if first["tools"] else None,
                                  return_assistant_tokens_mask=True, return_dict=True)
    marked = tok.decode([i for i, m in zip(got["input_ids"], got["assistant_masks"]) if m])
    assert marked.endswith("<|im_end|>") and "<|im_start|>" not in marked, marked
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(bpe_model)
    before = [p.detach().clone() for p in model.parameters()]
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=4, report_to="none", use_cpu=True,
                     save_strategy="no", max_length=512, learning_rate=1e-3, assistant_only_loss=True)
    out = SFTTrainer(model=model, args=args, train_dataset=rows.remove_columns(["tools"]) if not first["tools"] else rows,
                     processing_class=tok).train()
    assert math.isfinite(out.training_loss) and out.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_agents_sdk_agent_whose_answers_are_cut_trains_them_as_truncated_never_as_faults(tmp_path, bpe_model):
    """At rollout.max_response_length=12 the untrained BPE model's answers are mostly cut: the SDK raises on each
    (`incomplete`: ModelBehaviorError), as it does against OpenAI. Those episodes are truncated, not faults: counted
    (agent/truncated, rollout/truncated), kept and trained (consumed, scored by rollout.reward_fn on the last answer:
    rollout.overlong=keep); with rollout.overlong=mask they are out of the loss, which a kill and resume replays exactly."""
    over = [*SDK, f"model.actor.model_name_or_path={bpe_model}", "rollout.max_response_length=12", "rollout.overlong=keep",
            "rollout.max_fault_rate=0"]
    ref = tmp_path / "ref"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(ref / "journal") as j:
        steps = [StepEvents.of(rec) for rec in j.iter_steps()]
    for st in steps:
        samples = unpack(st.added.samples)
        cut = {s.id for s in samples if s.env_end == EnvEnd.LENGTH}
        assert st.metrics.values["rollout/faults"] == 0.0 and st.metrics.values["agent/truncated"] == len(cut) > 0
        assert st.metrics.values["rollout/truncated"] == len(cut)
        assert cut <= set(st.consumed.ids.tolist())  # trained, not left out as faults are
        assert all("ModelBehaviorError" in s.env_reason and "cut at its length" in s.env_reason for s in samples if s.id in cut)
    shown = cli("inspect", ref, "--step", "1", check=True).stdout
    assert "ended by length: the agent raised ModelBehaviorError" in shown, shown
    masked, over = tmp_path / "masked", [*over, "rollout.overlong=mask"]
    out = train(masked, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(masked / "journal") as j:
        first = unpack(StepEvents.of(next(iter(j.iter_steps()))).added.samples)
    assert all(s.env_end == EnvEnd.LENGTH for s in first)  # step 1 all cut: with mask, no token of it is in the loss
    assert metrics_of(masked)[1]["actor/entropy"] == 0.0 < metrics_of(ref)[1]["actor/entropy"]
    kill_and_resume(tmp_path / "run", masked, *over, failpoint="step.before_commit:2")


def metrics_of(run) -> dict[int, dict[str, float]]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: StepEvents.of(rec).metrics.values for rec in j.iter_steps()}


def test_an_agents_sdk_agent_reaches_verljs_tools_through_its_own_mcp_client_and_trains(tmp_path, bpe_model):
    """examples/agents_sdk_mcp.py on the bpe_model: the SDK's MCPServerStreamableHttp at episode.mcp_url lists rollout.tools
    (add: pure; submit: external), offers them to the policy in its own requests, and the run trains; every tool call the
    policy makes is journaled with its key (an untrained model seldom makes one whole)."""
    run = tmp_path / "run"
    out = train(run, "rollout.agent=examples.agents_sdk_mcp:solve", "rollout.tools=[examples.agents_sdk_mcp:add,examples.agents_sdk_mcp:submit]",
                "rollout.max_turns=3", "rollout.max_response_length=48", "rollout.overlong=reward", "trainer.total_steps=1",
                f"model.actor.model_name_or_path={bpe_model}", VERLJ_SUBMISSIONS=str(tmp_path / "submissions.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(run / "journal") as j:
        samples = [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]
    assert len(samples) == 16 and all(s.env_end in (EnvEnd.DONE, EnvEnd.LENGTH) for s in samples)  # no fault, none unresolved
    for s in samples:
        led = json.loads(s.agent_calls)
        req = json.loads(led["calls"][0]["request"])  # the SDK's own request: the MCP server's tools, as it listed them
        assert req["api"] == "responses" and sorted(t["function"]["name"] for t in req["tools"]) == ["add", "submit"]
        for t in led.get("tools", []):
            assert t["state"] == "done" and t["key"].endswith(f"-e{s.id}-t{led['tools'].index(t)}")
    submitted = (tmp_path / "submissions.jsonl").read_text().splitlines() if (tmp_path / "submissions.jsonl").exists() else []
    assert len(submitted) == sum(t["name"] == "submit" for s in samples for t in json.loads(s.agent_calls).get("tools", []))
