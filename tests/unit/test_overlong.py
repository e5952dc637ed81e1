"""rl.overlong: which samples hit their length limit (a response without its end token, an episode ended by length, an
agent episode whose last answer was cut, whether its agent then returned or raised), and what rollout.overlong does
with them: keep, mask (DAPO's overlong filtering: the update's mask), reward, penalty (DAPO's soft punishment)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from verlj.engine.config import ConfigError, make_config
from verlj.engine.rl import overlong
from verlj.engine.schema.sample import EnvEnd, Sample

EOS = 2


def single(response: list[int], score: float = 1.0, fault: str = "") -> Sample:
    return Sample(index=0, prompt_ids=np.asarray([1, 5], np.int64), response_ids=np.asarray(response, np.int64),
                  gen_logprobs=np.zeros(len(response), np.float32), score=score, fault=fault)


def episode(end: EnvEnd, actions: list[int], score: float = 1.0) -> Sample:
    lens = np.asarray([x for a in actions for x in (a, 1)], np.int64)
    n = int(lens.sum())
    return Sample(index=0, prompt_ids=np.asarray([1], np.int64), response_ids=np.full(n, 7, np.int64), gen_logprobs=np.zeros(n, np.float32),
                  env_end=int(end), turn_lens=lens, loss_mask=np.ones(n, np.int8), turn_rewards=np.zeros(len(actions)), score=score,
                  env_reason="the env fell over" if end == EnvEnd.FAULT else "")


def rollout(**over):
    return make_config(None, [f"rollout.{k}={v}" for k, v in {"max_response_length": 8, **over}.items()]).rollout


def test_what_hit_its_length_limit():
    assert overlong.truncated(single([5, 6, 7]), EOS)  # no end token: cut at the limit
    assert not overlong.truncated(single([5, 6, EOS]), EOS)
    assert overlong.truncated(episode(EnvEnd.LENGTH, [3, 2]), EOS)  # an episode (or an agent's) ended by length
    assert not any(overlong.truncated(episode(e, [3]), EOS) for e in (EnvEnd.DONE, EnvEnd.MAX_TURNS, EnvEnd.FAULT, EnvEnd.STOPPED))
    got = overlong.metrics([single([5]), single([5, EOS]), single([5], fault="reward function f raised"), episode(EnvEnd.LENGTH, [4])], EOS)
    assert got == {"rollout/truncated": 2.0}  # a faulted sample is a fault, not a truncated one


def test_keep_and_mask_leave_the_scores_and_mask_names_the_truncated_for_the_update():
    batch = [single([5, 6, 7], 0.5), single([5, EOS], 0.25), episode(EnvEnd.LENGTH, [3], 0.75)]
    for how in ("keep", "mask"):
        overlong.shape(batch, rollout(overlong=how), EOS)
        assert [s.score for s in batch] == [0.5, 0.25, 0.75]
    assert overlong.masked(batch, rollout(overlong="keep"), EOS) == []
    assert overlong.masked(batch, rollout(overlong="mask"), EOS) == [0, 2]


def test_reward_scores_the_truncated_and_penalty_is_dapos_soft_punishment():
    batch = [single([5, 6, 7], 0.5), single([5, EOS], 0.25), episode(EnvEnd.LENGTH, [3], 0.75), single([5], 0.5, fault="f raised")]
    overlong.shape(batch, rollout(overlong="reward", overlong_reward=-1.0), EOS)
    assert [s.score for s in batch] == [-1.0, 0.25, -1.0, 0.5]
    # Lmax 8, buffer 4, p 0.5: L <= 4 loses nothing, L in (4, 8] loses 0.5 (L - 4) / 4, a truncated sample all of 0.5
    lengths = [2, 4, 5, 6, 7]
    batch = [single([5] * (n - 1) + [EOS], 1.0) for n in lengths] + [single([5] * 8, 1.0), episode(EnvEnd.LENGTH, [2], 1.0),
                                                                      episode(EnvEnd.DONE, [3, 7], 1.0)]
    overlong.shape(batch, rollout(overlong="penalty", overlong_buffer=4, overlong_penalty=0.5), EOS)
    assert [s.score for s in batch] == [1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.5, 0.625]  # an episode: its last action's length


@pytest.mark.parametrize("over, says", [
    ({"overlong": "clip"}, "rollout.overlong must be one of keep, mask, reward, penalty"),
    ({"overlong": "penalty"}, "rollout.overlong=penalty needs rollout.overlong_buffer between 1 and rollout.max_response_length (8)"),
    ({"overlong": "penalty", "overlong_buffer": 9}, "needs rollout.overlong_buffer between 1 and rollout.max_response_length (8)"),
    ({"overlong_buffer": -1}, "rollout.overlong_buffer must be at least 0"),
])
def test_bad_overlong_values_are_one_line(over, says):
    with pytest.raises(ConfigError) as e:
        rollout(**over)
    assert says in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- agent episodes cut at their length


def cut_then(raise_it: bool):
    """An agent whose one answer is cut at max_tokens=2 (the scripted policy writes more), then raises or returns."""
    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        got = client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.row["prompt"]}],
                                             max_tokens=2 if ep.row["prompt"] != "row 1" else None)
        if raise_it:
            raise ValueError(f"the answer ended by {got.choices[0].finish_reason}")
        return 0.5
    return agent


def test_an_agent_that_raises_after_its_answer_was_cut_ended_by_length_and_one_after_a_whole_answer_is_a_fault():
    from test_gateway import play

    started: list = []  # the gateways the plays start, stopped after
    try:
        out, *_ = play(cut_then(True), n=2, answers={"row 0": "abcdef", "row 1": "ab"}, cleanup=started)
        cut, whole = out
        assert cut.fault == "" and cut.reward is None and cut.cut.startswith("the agent raised ValueError: the answer ended by length")
        assert cut.cut.endswith("after its last answer was cut at its length")
        assert whole.fault.startswith("the agent raised ValueError: the answer ended by stop") and whole.cut == ""
        out, *_ = play(cut_then(False), n=2, answers={"row 0": "abcdef", "row 1": "ab"}, cleanup=started)
        assert [(p.fault, p.reward, p.cut) for p in out] == [("", 0.5, "its last answer was cut at its length"), ("", 0.5, "")]
    finally:
        for gw in started:
            gw.stop()
