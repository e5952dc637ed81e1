"""A verifiers taskset (examples/verifiers_taskset.py: an in-memory task list, two @vf.reward functions) trained as it is
on the bpe_model with rollout.agent=verifiers:TASKSET: each episode played by verifiers' chat program in a subprocess
against the gateway, every call journaled, the sample's reward the tasks' weighted rewards of its answer, each named
reward a metric; SIGKILLed before a commit (sync on verlj's sampler and on vLLM, async step order, and on a Ray fleet: the harness
plays against the trainer's gateway, the actors generate) and resumed, bit-identical to the uninterrupted run; replayed bit for
bit. Needs the `verifiers` extra (the README's test command installs it, with `vllm` and `ray` beside it)."""

from __future__ import annotations

import json

import pytest

from verlj.engine.rl.gateway.wire import read_answer
from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import EnvEnd, unpack
from verlj.journal import open_journal_reader
from verlj_testing import REPO, kill_and_resume, replay_here, train

TASKSET = "verifiers:examples.verifiers_taskset"
OVER = [f"data.train_dataset={TASKSET}", f"rollout.agent={TASKSET}", "data.prompts_per_step=2", "rollout.n=2",
        "rollout.max_response_length=16", "rollout.agent_concurrency=4", "trainer.total_steps=2", "trainer.save_interval=1"]


def answers() -> list[str]:
    """Each dataset row's question's answer (a row's own answer is its task's key), as the taskset loads them."""
    import sys

    import verifiers.v1 as vf

    from verlj.engine.config import DataConfig
    from verlj.engine.rl.data import load_data

    sys.path.insert(0, str(REPO))
    from examples.verifiers_taskset import ArithmeticTaskset

    truth = {t.key: t.data.answer for t in ArithmeticTaskset(vf.TasksetConfig())}
    return [truth[ex.answer] for ex in load_data(DataConfig(train_dataset=TASKSET), 0).train]


FLEET = ["rollout.mode=async", "rollout.async_order=step", "rollout.fleet=ray", "rollout.fleet_size=2"]  # a Ray the trainer starts


@pytest.mark.parametrize("mode", [["rollout.mode=sync"], ["rollout.mode=async", "rollout.async_order=step"], ["rollout.engine=vllm"], FLEET],
                         ids=["sync", "async_step", "vllm", "fleet"])
def test_a_verifiers_taskset_trains_on_its_named_rewards_and_a_kill_resumes_bit_identical(tmp_path, bpe_model, mode):
    ref, run = tmp_path / "ref", tmp_path / "run"
    over = [*OVER, *mode, f"model.actor.model_name_or_path={bpe_model}"]
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    truth = answers()
    with open_journal_reader(ref / "journal") as j:
        steps = [StepEvents.of(rec) for rec in j.iter_steps()]
    for st in steps:
        samples = unpack(st.added.samples)
        assert len(samples) in (4, 8) and all(s.env_end in (EnvEnd.DONE, EnvEnd.LENGTH) and s.agent_calls for s in samples)
        exact = number = 0.0
        for s in samples:
            led = json.loads(s.agent_calls)
            assert len(led["calls"]) == 1  # the chat program asks once: its task has no tools
            req = json.loads(led["calls"][0]["request"])  # verifiers' chat program's request, relayed by its interception
            assert req["stream"] is True and req["messages"][-1]["content"].startswith("What is ")
            reply = read_answer(led["calls"][0]["response"].encode()).content.strip()
            want = truth[int(s.index)]
            e, n = float(reply == want), float(reply.removeprefix("-").isdigit())
            assert s.rule_reward == led["reward"] == e * 1.0 + n * 0.1  # the tasks' @vf.reward functions, weighted
            exact, number = exact + e, number + n
        values = st.metrics.values
        assert values["reward/verifiers/exact"] == exact and values["reward/verifiers/number"] == number  # summed
    kill_and_resume(run, ref, *over, failpoint="step.before_commit:2")
    report, line = replay_here(run, 2)
    assert line == "" and report


def test_a_verifiers_taskset_in_completion_order_answers_the_journaled_calls_from_the_journal(tmp_path, bpe_model):
    """Completion order, killed at step 2's last durable write (calls of its episodes journaled, the step not
    committed) and resumed: the harness played again, those calls answered from the journal, none generated twice, no
    divergence, and the journal and fingerprints of the uninterrupted run."""
    from verlj_testing import assert_same_journal, cli, fingerprints

    over = [*OVER, "rollout.mode=async", "rollout.async_order=completion", f"model.actor.model_name_or_path={bpe_model}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(ref / "journal") as j:
        writes = [int(StepEvents.of(rec).metrics.values["agent/durable_writes"]) for rec in j.iter_steps()]
    assert writes[1] >= 1, writes
    out = train(run, *over, VERLJ_FAILPOINT=f"agents.after_durable:{writes[0] + writes[1]}")
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    got, want = (json.loads(cli("inspect", r, "--json", check=True).stdout)["agents"] for r in (run, ref))
    assert got["calls_from_journal"] > 0 and got["divergences"] == 0, got
    assert got["calls_generated"] + got["calls_from_journal"] == want["calls_generated"]  # no completed call generated twice
    assert_same_journal(run, ref, ignore=("agent/calls", "agent/durable_writes"))
    assert fingerprints(run) == fingerprints(ref)
