"""A fault's reason names where in the user's code it broke: an env, an agent or a reward function that
raises gives a reason ending "(at my_env.py:42)", the innermost frame of its traceback outside verlj's own
package and outside the libraries it called (engine.plugins.raised_at)."""

from __future__ import annotations

import importlib
import sys

import pytest

from verlj.engine.plugins import raised_at
from verlj.engine.rl.data import Example
from verlj.engine.rl.envs import EnvFault, safe_reset, safe_step
from verlj.engine.rl.rewards import RewardError, rule_rewards, scored_or_faults

USER = '''import json


class Env:
    def reset(self, row, seed):
        return "obs"

    def step(self, action):
        return json.loads("{")  # a library raises; the user's line is this one (line 9)


def reward(prompt, response, answer):
    raise KeyError("answer")  # line 13


def agent(ep):
    raise RuntimeError("the sandbox is down")  # line 17
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_env", None)
    return importlib.import_module("my_env")


def test_an_env_that_raises_in_a_library_names_the_users_line(user):
    got = safe_step(user.Env(), "a", 5.0)
    assert isinstance(got, EnvFault) and str(got).startswith("raised JSONDecodeError: ") and str(got).endswith(" (at my_env.py:9)")
    assert safe_reset(user.Env(), {}, 0, 5.0) == "obs"


def test_a_reward_function_that_raises_names_its_line_in_the_fault_and_the_error(user):
    _, faults = scored_or_faults(user.reward, ["p"], ["r"], [Example("1+1=", "2")])
    assert faults == ["reward function my_env.reward raised KeyError: 'answer' (at my_env.py:13)"]
    with pytest.raises(RewardError) as e:
        rule_rewards(user.reward, ["1+1="], ["r"], [Example("1+1=", "2")])
    assert str(e.value).endswith("(prompt '1+1=') (at my_env.py:13)")


def test_an_agent_that_raises_names_its_line(user):
    from verlj.engine.rl.gateway.prompts import Prompts
    from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
    from verlj.engine.rl.gateway.server import Gateway

    gw = Gateway("m").start()
    try:
        out = Runner(gw, user.agent, Prompts(None, lambda m, t, g: ""), lambda p, s, e, o=None: ([], []), Settings(1, 5.0, 1)).play(
            Episodes([{}], [0], [0], lambda place, k: 0))
    finally:
        gw.stop()
    assert out[0].fault == "the agent raised RuntimeError: the sandbox is down (at my_env.py:17)"


def test_only_verlj_and_library_frames_fall_back_and_none_outside_says_nothing():
    try:
        importlib.import_module("json").loads("{")
    except ValueError as e:
        assert raised_at(e) == f" (at test_fault_location.py:{e.__traceback__.tb_lineno})"  # this file: the user's
        e.__traceback__ = e.__traceback__.tb_next  # the library's frames alone: the innermost outside verlj
        assert raised_at(e).startswith(" (at ") and "decoder.py:" in raised_at(e)
    assert raised_at(ValueError("never raised")) == ""
    from verlj.engine.rl.gateway.protocol import ApiError, parse_request

    try:
        parse_request(b"{", "m")
    except ApiError as e:
        assert e.__traceback__ is not None and e.__traceback__.tb_next is not None
        assert raised_at(e.with_traceback(e.__traceback__.tb_next)) == ""  # verlj's own frames alone: nothing to name
