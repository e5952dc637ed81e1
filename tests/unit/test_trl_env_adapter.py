"""rl.trl_envs: a TRL environment class as a verlj env, on the bpe_tokenizer's ChatML template: its tools described as
transformers describes them, the reset's text joined to the last user message, the policy's calls dispatched and
answered as TRL answers them (results, errors), the episode's end scored as TRL scores a sample."""

from __future__ import annotations

import math

import numpy as np
import pytest

from verlj.engine.config import make_config
from verlj.engine.errors import ConfigError
from verlj.engine.rl.models import chat_template
from verlj.engine.rl.trl_envs import Prompt, RewardFuncs, TrlEnv, columns_of, prompt_of, tool_methods, tool_schemas


class Counter:
    def reset(self, **kwargs) -> str | None:
        self.count, self.seen = 0, kwargs
        return " Count to 3."

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: How much to add.

        Returns:
            The counter.
        """
        self.count += step
        return self.count

    def explode(self) -> str:
        """
        Always fails.
        """
        raise RuntimeError("boom")

    def get_reward(self) -> float:
        return 0.5 if self.count == 3 else 0.0

    def _private(self) -> None:
        raise AssertionError("never a tool")

    @property
    def evaluated(self) -> int:
        raise AssertionError("a property is never evaluated to list the tools")


class Undocumented:
    def reset(self, **kwargs) -> None:
        return None

    def tool(self, x):
        return x


ROW = {"prompt": "rendered", "answer": "3", "task": "", "entry": None, "messages": [{"role": "user", "content": "Go."}],
       "data_source": None, "extra_info": None}
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def made(tok, rewards: RewardFuncs | None = None, max_turns: int = 3) -> TrlEnv:
    instance = Counter()
    return TrlEnv(instance, chat_template(tok, False), tok, tool_schemas(instance), rewards or RewardFuncs((), (), True), max_turns)


def test_the_tools_are_the_public_methods_described_as_transformers_describes_them():
    from transformers.utils import get_json_schema

    assert tool_methods(Counter) == ["explode", "increment"]
    c = Counter()
    assert tool_schemas(c) == [get_json_schema(c.explode), get_json_schema(c.increment)]
    assert tool_schemas(c)[1]["function"]["parameters"]["properties"]["step"] == {"type": "integer", "description": "How much to add."}
    with pytest.raises(ConfigError, match=r"^rollout.env: the tool Undocumented.tool cannot be described to the model .*docstring$"):
        tool_schemas(Undocumented())


def test_reset_joins_the_last_user_message_and_renders_the_tools(bpe_tokenizer):
    env = made(bpe_tokenizer)
    prompt = env.reset(ROW, 7)
    assert isinstance(prompt, Prompt)
    assert prompt == bpe_tokenizer.apply_chat_template([{"role": "user", "content": "Go. Count to 3."}], tools=[Counter().explode, Counter().increment],
                                                       tokenize=False, add_generation_prompt=True)
    assert env.env.seen == {"prompt": [{"role": "user", "content": "Go."}], "answer": "3"}
    assert prompt_of({**ROW, "messages": None}) == [{"role": "user", "content": "rendered"}]
    assert columns_of({**ROW, "data_source": "d"}) == {"answer": "3", "data_source": "d"}


def test_a_call_is_dispatched_and_answered_as_a_tool_message_after_the_end_of_turn(bpe_tokenizer):
    env = made(bpe_tokenizer)
    env.reset(ROW, 0)
    obs, reward, done = env.step(CALL.format(name="increment", args='{"step": 2}'))
    assert (obs, reward, done) == ("\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n", None, False)
    assert env.env.count == 2


@pytest.mark.parametrize("call, said", [
    (CALL.format(name="nope", args="{}"), "{'error': 'Tool nope not found.'}"),
    (CALL.format(name="explode", args="{}"), "{'error': 'boom'}"),
    (CALL.format(name="increment", args='{"stride": 1}'), "{'error': \"Counter.increment() got an unexpected keyword argument 'stride'\"}"),
])
def test_a_failing_call_is_a_tool_message_holding_the_error_as_trl_writes_it(bpe_tokenizer, call, said):
    env = made(bpe_tokenizer)
    env.reset(ROW, 0)
    obs, _, done = env.step(call)
    assert obs == f"\n<|im_start|>user\n<tool_response>\n{said}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" and not done


def test_an_answer_without_a_call_ends_the_episode_scored_by_get_reward_and_the_reward_functions(bpe_tokenizer):
    got = {}

    def reward(prompts, completions, environments, answer, **kwargs):
        got.update(prompts=prompts, completions=completions, environments=environments, answer=answer, ids=kwargs["completion_ids"])
        return [2.0]

    def abstains(prompts, completions, **kwargs):
        return [None]

    env = made(bpe_tokenizer, RewardFuncs((reward, abstains), (0.25, 9.0), True))
    env.reset(ROW, 0)
    env.step(CALL.format(name="increment", args='{"step": 3}'))
    obs, r, done = env.step("three")
    assert (obs, r, done) == ("", 0.25 * 2.0 + 0.5, True)  # the weighted function, get_reward's 0.5; the None left out
    assert got["environments"] == [env.env] and got["answer"] == ["3"]
    assert got["prompts"] == [[{"role": "user", "content": "Go. Count to 3."}]]
    assert [m["role"] for m in got["completions"][0]] == ["assistant", "tool", "assistant"]
    assert got["completions"][0][0]["tool_calls"] == [{"type": "function", "function": {"name": "increment", "arguments": {"step": 3}}}]
    assert got["completions"][0][1] == {"role": "tool", "name": "increment", "content": "3"} and got["completions"][0][2]["content"] == "three"
    assert got["ids"] and isinstance(got["ids"][0][0], int)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("again")


def test_the_last_turn_ends_the_episode_without_running_its_calls(bpe_tokenizer):
    env = made(bpe_tokenizer, max_turns=1)
    env.reset(ROW, 0)
    assert env.step(CALL.format(name="increment", args='{"step": 3}')) == ("", 0.0, True) and env.env.count == 0


def test_a_reward_function_that_answers_no_list_of_one_or_no_number_raises_naming_it(bpe_tokenizer):
    env = made(bpe_tokenizer, RewardFuncs((lambda **kw: [1.0, 2.0],), (1.0,), False))
    env.reset(ROW, 0)
    with pytest.raises(ValueError, match="must return a list of one reward per completion"):
        env.step("done")
    env = made(bpe_tokenizer, RewardFuncs((lambda **kw: [math.nan],), (1.0,), False))
    env.reset(ROW, 0)
    with pytest.raises(ValueError, match="returned nan, not a finite number or None"):
        env.step("done")


def test_a_reward_function_that_raises_is_named_in_the_episodes_fault(bpe_tokenizer):
    from verlj.engine.rl.trl_envs import RewardFuncError

    def boom(**kwargs):
        raise KeyError("answer")

    env = made(bpe_tokenizer, RewardFuncs((boom,), (1.0,), False))
    env.reset(ROW, 0)
    with pytest.raises(RewardFuncError, match=r"^rollout.env_reward_funcs: \S*boom raised KeyError: 'answer'$"):
        env.step("done")


def test_the_reward_funcs_need_a_trl_env_and_one_weight_each():
    with pytest.raises(ConfigError, match="need rollout.env=trl:module:Class"):
        make_config(None, ["rollout.env_reward_funcs=[m:f]"])
    with pytest.raises(ConfigError, match="has 2 weights for 1 rollout.env_reward_funcs"):
        make_config(None, ["rollout.env=trl:m:C", "rollout.env_reward_funcs=[m:f]", "rollout.env_reward_weights=[1.0,2.0]"])
    with pytest.raises(ConfigError, match="as trl:module:Class"):
        make_config(None, ["rollout.env=trl:Gone"])


TRL_MOD = '''
class Good:
    def reset(self, **kwargs):
        return None

    def shout(self, text: str) -> str:
        """
        Shout it.

        Args:
            text: What to shout.
        """
        return text.upper()

    def get_reward(self) -> float:
        return 1.0


class NoReset:
    def shout(self, text: str) -> str:
        """
        Shout it.

        Args:
            text: What to shout.
        """
        return text


class NoReward:
    def reset(self, **kwargs):
        return None


class Vague(Good):
    def whisper(self, text):
        return text


class Fragile(Good):
    def __init__(self):
        raise OSError("no sandbox")


class Tally:
    def reset(self, **kwargs):
        self.total = 0

    def add(self, n: int) -> int:
        """
        Add to the tally.

        Args:
            n: How much.
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def reward(prompts, completions, **kwargs):
    return [1.0]


def single(completion):
    return [1.0]
'''


def trl_cfg(spec: str, *funcs: str):
    from verlj.engine.config import Config

    cfg = Config()
    cfg.rollout.env, cfg.rollout.max_turns, cfg.rollout.env_reward_funcs = spec, 3, list(funcs)
    cfg.model.tiny.vocab, cfg.data.max_prompt_length = "ascii", 512  # the tools' schemas are in the prompt
    return cfg


@pytest.fixture
def trl_mod(tmp_path, monkeypatch):
    (tmp_path / "trl_user_mod.py").write_text(TRL_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("spec, funcs, message", [
    ("trl:trl_user_mod:NoReset", (), "rollout.env: trl:trl_user_mod:NoReset made NoReset, which has no reset(**kwargs) (a TRL environment class needs one)"),
    ("trl:trl_user_mod:NoReward", (), "rollout.env: trl:trl_user_mod:NoReward has no get_reward() and rollout.env_reward_funcs names no reward "
     "function: name one (TRL's reward_funcs), or give the class a get_reward()"),
    ("trl:trl_user_mod:Fragile", (), "rollout.env: making trl:trl_user_mod:Fragile failed: OSError: no sandbox"),
    ("trl:trl_user_mod:Gone", (), "rollout.env: cannot import 'trl:trl_user_mod:Gone' (module 'trl_user_mod' has no 'Gone')"),
    ("trl:trl_user_mod:Good", ("trl_user_mod:nothing",), "rollout.env_reward_funcs: cannot import 'trl_user_mod:nothing' (module 'trl_user_mod' has no 'nothing')"),
])
def test_a_class_or_reward_function_that_cannot_be_used_is_one_config_error(trl_mod, spec, funcs, message):
    from verlj.engine.rl.envs import load_env

    with pytest.raises(ConfigError) as e:
        load_env(trl_cfg(spec, *funcs))
    assert str(e.value) == message


def test_an_undescribable_tool_and_a_reward_function_of_another_signature_are_config_errors(trl_mod):
    from verlj.engine.rl.envs import load_env

    with pytest.raises(ConfigError, match=r"^rollout.env: the tool Vague.whisper cannot be described to the model"):
        load_env(trl_cfg("trl:trl_user_mod:Vague"))
    with pytest.raises(ConfigError, match=r"^rollout.env_reward_funcs: trl_user_mod:single \(called as fn\(prompts=, completions=, "
                                          r"environments=, \.\.\.\)\) has the wrong signature"):
        load_env(trl_cfg("trl:trl_user_mod:Good", "trl_user_mod:single"))


def test_a_rounds_episode_takes_the_prompt_its_trl_env_rendered(trl_mod):
    """The built-in model's template (the tools leading as a system message): the episode's prompt is the Prompt reset
    answered, <bos> first, in place of the dataset prompt's ids; a step dispatches to that episode's own instance."""
    from verlj.engine.rl.envs import load_env
    from verlj.engine.rl.episodes import Limits, Round
    from verlj.engine.rl.models import load_tokenizer

    cfg = trl_cfg("trl:trl_user_mod:Good", "trl_user_mod:reward")
    tok = load_tokenizer("builtin:tiny", cfg=cfg)
    factory = load_env(cfg)
    rnd = Round(factory, [{**ROW, "messages": [{"role": "user", "content": "hi"}]}] * 2, [1, 2], [np.asarray([1, 5, 6])] * 2, tok,
                Limits(3, 10.0))
    text = '<|system|>\nTools: [{"type": "function", "function": {"name": "shout", "description": "Shout it.", "parameters": ' \
           '{"type": "object", "properties": {"text": {"type": "string", "description": "What to shout."}}, "required": ["text"]}, "return": {"type": "string"}}}]\n' \
           '<|user|>\nhi\n<|assistant|>\n'
    want = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]
    assert [p.tolist() for p in rnd.first_prompts()] == [want, want]
    assert rnd.episodes[0].env.env is not rnd.episodes[1].env.env  # one instance an episode
    call = tok('<tool_call>{"name": "shout", "arguments": {"text": "hey"}}</tool_call>', add_special_tokens=False).input_ids
    rnd.take([0, 1], [np.asarray(call), np.asarray(tok("bye", add_special_tokens=False).input_ids)], [np.zeros(len(call)), np.zeros(3)])
    obs = tok.decode(rnd.episodes[0].response[len(call):])
    assert obs == "<|tool|>\nHEY\n<|assistant|>\n" and rnd.episodes[0].live
    assert not rnd.episodes[1].live and rnd.env_score(1) == 2.0  # reward (1.0) and get_reward (1.0) at its answer


def test_an_episode_in_flight_is_rebuilt_by_replaying_its_actions_on_a_fresh_instance(trl_mod):
    """Completion order's restore (Round.restored): a fresh instance reset on the row, the durable tool call dispatched
    again, so the next turn finds the state the first left and the episode ends with the reward it would have had."""
    from verlj.engine.rl.envs import load_env
    from verlj.engine.rl.episodes import Limits, Round
    from verlj.engine.rl.models import load_tokenizer

    cfg = trl_cfg("trl:trl_user_mod:Tally")
    tok = load_tokenizer("builtin:tiny", cfg=cfg)
    factory, limits, rows = load_env(cfg), Limits(3, 10.0), [ROW, ROW]
    ids = [np.asarray(tok(t, add_special_tokens=False).input_ids) for t in ('<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>', "5")]
    played = Round(factory, rows, [1, 2], [np.asarray([1])] * 2, tok, limits)
    played.take([0, 1], ids, [np.zeros(len(i)) for i in ids])
    assert played.episodes[0].live and not played.episodes[1].live and played.env_score(1) == 0.0
    rebuilt, replayed = Round.restored(factory, rows, played.state(0, 0, [0]), tok, limits)
    assert replayed == 1 and rebuilt.episodes[0].env.env is not played.episodes[0].env.env
    assert rebuilt.episodes[0].env.env.total == 5 and rebuilt.episodes[1].env is None
    assert [p.tolist() for p in rebuilt.first_prompts()] == [p.tolist() for p in played.first_prompts()]
    for rnd in (played, rebuilt):
        rnd.take([0], [ids[1]], [np.zeros(len(ids[1]))])
    assert played.env_score(0) == rebuilt.env_score(0) == 5.0 and played.fields(0)["response_ids"].tolist() == rebuilt.fields(0)["response_ids"].tolist()


def test_a_prompt_longer_than_data_max_prompt_length_is_the_resets_fault(bpe_tokenizer):
    from verlj.engine.rl.envs import EnvFault, safe_reset

    instance = Counter()
    env = TrlEnv(instance, chat_template(bpe_tokenizer, False), bpe_tokenizer, tool_schemas(instance), RewardFuncs((), (), True), 3, 64)
    got = safe_reset(env, ROW, 0, 10.0)
    assert isinstance(got, EnvFault) and got.reason.startswith("raised ValueError: the prompt with its tools is ")
    assert "tokens, more than data.max_prompt_length (64): raise it" in got.reason
