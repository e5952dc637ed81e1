"""A TRL environment class as rollout.env (examples/trl_env.py, as TRL's docs write one) on the bpe_model: its tool
offered in the prompt through the chat template, the policy's calls dispatched to the episode's instance and answered
as tool messages (masked from the loss), the reward (get_reward and a TRL reward function given environments=) journaled
with the last turn. Killed before a commit and resumed, in sync mode (on hf and on vLLM) and in async step order: the journal and the
fingerprints of the uninterrupted run; replay reproduces them without the environment."""

from __future__ import annotations

import numpy as np
import pytest

from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import unpack
from verlj.journal import open_journal_reader
from verlj_testing import fingerprints, kill_and_resume, train, verlj

TRL = ["rollout.env=trl:examples.trl_env:AdderEnv", "rollout.env_reward_funcs=[examples.trl_env:reward_func]", "rollout.max_turns=3",
       "rollout.max_response_length=32", "data.max_prompt_length=384", "trainer.total_steps=3", "trainer.save_interval=2"]


def samples_of(run) -> list:
    with open_journal_reader(run / "journal") as j:
        return [s for rec in j.iter_steps() for s in unpack(StepEvents.of(rec).added.samples)]


@pytest.mark.parametrize("mode", [[], ["rollout.mode=async", "rollout.async_order=step"], ["rollout.engine=vllm"]],
                         ids=["sync", "step_order", "vllm"])
def test_a_trl_class_trains_with_its_tools_and_a_kill_resumes_bit_identical(tmp_path, bpe_model, mode):
    from transformers import AutoTokenizer

    over = [f"model.actor.model_name_or_path={bpe_model}", *TRL, *mode]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "faults 0/16" in out.stdout, out.stdout[-2000:]
    tok = AutoTokenizer.from_pretrained(bpe_model, local_files_only=True)
    samples = samples_of(ref)
    prompt = tok.decode(samples[0].prompt_ids)
    assert '"name": "add"' in prompt and "Add two integers." in prompt  # the tool's schema, from the hints and docstring
    assert prompt.endswith("= Use the add tool.<|im_end|>\n<|im_start|>assistant\n")  # reset's text joined the user message
    tooled = [s for s in samples if len(s.turn_lens) > 2]
    assert tooled  # the policy called the tool: its answer came back as a tool message, and the policy went on
    for s in tooled:
        a, o = int(s.turn_lens[0]), int(s.turn_lens[1])
        assert tok.decode(s.response_ids[a : a + o]).startswith("\n<|im_start|>user\n<tool_response>\n")
        assert not s.loss_mask[a : a + o].any() and s.loss_mask[:a].all()
        assert np.isnan(s.turn_rewards[0]) and not np.isnan(s.turn_rewards[-1])  # the reward at the episode's end
    assert {round(float(s.score), 4) for s in samples} >= {0.0, 1.0}  # reward_func's sums, and misses
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:3")
    want = fingerprints(ref)
    rep = verlj("replay", ref, "--to-step", "3")  # from step 2's snapshot: step 3 read from the journal, its env never made
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert want[3] in rep.stdout


def test_a_trl_class_in_completion_order_killed_mid_episode_loses_no_turn_and_trains_nothing_twice(tmp_path, bpe_model):
    """Killed after step 1's commit, then with turns of groups asked ahead durable: resumed to the end, the committed
    steps unchanged, every group accounted for (asked once, arrived once, trained or dropped once at most), the episodes
    in flight rebuilt from their durable turns by replaying their actions on fresh instances."""
    from test_async_completion import kill_mid_episode_and_resume

    over = [f"model.actor.model_name_or_path={bpe_model}", *TRL, "rollout.mode=async", "rollout.async_order=completion"]
    kill_mid_episode_and_resume(tmp_path / "run", *over)  # a rebuilt episode's instance is tests/unit/test_trl_env_adapter.py's
