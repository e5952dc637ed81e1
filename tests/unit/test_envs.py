"""rl.envs: the Environment protocol, the built-ins (calculator, guess, reasoning-gym attempts), restore()
by replaying actions, safe_reset/safe_step on envs that raise, return the wrong thing or hang, and
loading rollout.env with one ConfigError for every way it can fail."""

import threading
import time

import numpy as np
import pytest
from envs_for_tests import CharTok

from verlj.engine.config import Config, ConfigError, DataConfig, ReasoningGymConfig, policy_of
from verlj.engine.rl import envs, tasks
from verlj.engine.rl.data import Example
from verlj.engine.rl.envs import (
    STEP_FORMS,
    CalcError,
    Calculator,
    EnvFault,
    Environment,
    Equals,
    Guess,
    ReasoningGymAttempts,
    StepResult,
    calculate,
    load_env,
    restore,
    row_of,
    safe_reset,
    safe_step,
)
from verlj_testing import raised_at

ADD_ROW = row_of(Example("3+4=", "7"))


def episode(env, row, seed, actions):
    """The first observation and every StepResult of `actions` on a fresh episode."""
    return [env.reset(row, seed)] + [env.step(a) for a in actions]


def cfg_with(env, max_turns=3, train_dataset="builtin:add"):
    """A config naming `env` (set after validation: training refuses rollout.env until the rollout runs episodes)."""
    cfg = Config()
    cfg.rollout.env, cfg.rollout.max_turns, cfg.data.train_dataset = env, max_turns, train_dataset
    cfg.data.reasoning_gym.size = 8
    return cfg


def rg_dataset(task="basic_arithmetic"):
    ds, _ = tasks.generate(DataConfig(train_dataset=f"reasoning_gym:{task}", reasoning_gym=ReasoningGymConfig(size=8)), seed=3)
    return ds


# ----------------------------------------------------------------------------- determinism


def test_builtins_are_environments_and_results_are_frozen():
    for env in (Calculator(2), Guess(2), ReasoningGymAttempts(lambda a, e: 0.0, 2)):
        assert isinstance(env, Environment)
    assert not isinstance(object(), Environment)
    with pytest.raises(AttributeError):
        StepResult("", None, False).done = True


def test_same_seed_and_actions_give_the_same_observations():
    actions = ["50", "25", "75", "12", "88", "<answer>60</answer>", "x"]
    runs = [episode(Guess(7), ADD_ROW, 11, actions) for _ in range(2)]
    assert runs[0] == runs[1]
    calc = ["<calc>12*(3+4)</calc>", "<calc>7/0</calc>", "84"]
    assert episode(Calculator(3), ADD_ROW, 5, calc) == episode(Calculator(3), ADD_ROW, 99, calc)


def test_the_guess_secret_comes_from_the_seed_alone():
    secrets = {}
    for seed in (0, 1, 2, 3, 2**63 - 1):
        env = Guess(7)
        env.reset(ADD_ROW, seed)
        secrets[seed] = env.secret
        again = Guess(7)
        again.reset({"prompt": "other row", "answer": "0"}, seed)
        assert again.secret == env.secret and 1 <= env.secret <= 100
    assert len(set(secrets.values())) > 1
    # blake3 of the seed, the same on every machine and Python: a journaled episode restores anywhere
    assert secrets[0] == 1 + int.from_bytes(__import__("blake3").blake3(b"guess/0").digest()[:8], "big") % 100


# ----------------------------------------------------------------------------- builtin:guess


@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_guess_binary_search_wins_and_the_hints_point_at_the_secret(seed):
    env = Guess(7)
    assert env.reset(ADD_ROW, seed) == "Guess a whole number from 1 to 100; you have 7 guesses. Answer with the number only."
    lo, hi = 1, 100
    for _ in range(7):
        mid = (lo + hi) // 2
        r = env.step(f" {mid}\n")
        if r.done:
            assert r == StepResult("", 1.0, True) and mid == env.secret
            break
        assert r.reward is None and r.observation in ("higher", "lower")
        lo, hi = (mid + 1, hi) if r.observation == "higher" else (lo, mid - 1)
        assert lo <= env.secret <= hi
    else:
        pytest.fail("binary search did not find the secret in 7 guesses")


def test_guess_ends_with_zero_when_the_turns_run_out():
    env = Guess(3, lo=1, hi=1000)
    env.reset(ADD_ROW, 4)
    wrong = str(env.secret % 1000 + 1)
    assert env.step("a guess?") == StepResult("not a number", None, False)
    assert env.step(wrong).done is False
    assert env.step(wrong) == StepResult("", 0.0, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(str(env.secret))
    with pytest.raises(RuntimeError, match="before reset"):
        Guess(3).step("1")
    one = Guess(1)
    one.reset(ADD_ROW, 4)
    assert one.step(str(one.secret)) == StepResult("", 1.0, True)


# ----------------------------------------------------------------------------- builtin:calculator


@pytest.mark.parametrize("expression, value", [
    ("12+7", "19"), ("2*(3+4)", "14"), (" 7 / 2 ", "3.5"), ("7//2", "3"), ("-7 % 3", "2"), ("-(2-5)", "3"),
    ("2**10", "1024"), ("2**-2", "0.25"), ("1/3", "0.333333333333"), ("(1/3)*3", "1"), ("10**64", "1" + "0" * 64),
])
def test_calculate_evaluates_integer_arithmetic_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("x+1", "Name is not arithmetic"), ("abs(-1)", "Call is not arithmetic"), ("__import__('os').system('true')", "Call"),
    ("(1).real", "Attribute"), ("1.5+1", "Constant"), ("'a'*3", "Constant"), ("True+1", "Constant"), ("[1][0]", "Subscript"),
    ("1 if 1 else 0", "IfExp"), ("1<2", "Compare"), ("1 & 3", "BinOp"), ("2**1000000", "exponents must be integers from -64"),
    ("9**9**9", "exponents must be"), ("99**60", "over 100 digits"), ("(10**60)*(10**60)", "over 100 digits"),
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("0**-1", "division by zero"),
    ("1+" * 200 + "1", "longer than 256"), ("1+", "not an arithmetic expression"), ("", "not an arithmetic expression"),
])
def test_calculate_refuses_anything_but_bounded_arithmetic(expression, why):
    t = time.monotonic()
    with pytest.raises(CalcError, match=why.replace("(", r"\(").replace("*", r"\*")):
        calculate(expression)
    assert time.monotonic() - t < 0.5  # a huge power is refused before it is computed


def test_calculator_answers_tool_calls_then_scores_the_final_answer():
    env = Calculator(4)
    assert env.reset(ADD_ROW, 0) == ""
    assert env.step("Let me add. <calc>3+4</calc> and more") == StepResult("<result>7</result>", None, False)
    assert env.step("<calc>import os</calc>") == StepResult("<result>error</result>", None, False)
    assert env.step("<answer> 7 </answer>") == StepResult("", 1.0, True)
    env.reset(ADD_ROW, 0)
    assert env.step("8") == StepResult("", 0.0, True)
    env.reset(ADD_ROW, 0)
    assert env.step("+7") == StepResult("", 1.0, True)


def test_calculator_last_turn_ends_the_episode_even_on_a_tool_call():
    env = Calculator(2)
    env.reset(ADD_ROW, 0)
    assert env.step("<calc>1+1</calc>").done is False
    assert env.step("<calc>3+4</calc>") == StepResult("", 0.0, True)


def test_calculator_scores_reasoning_gym_arithmetic_rows():
    ds = rg_dataset("basic_arithmetic")
    row = row_of(Example(ds[0]["question"], str(ds[0]["answer"]), "basic_arithmetic", ds[0]))
    expression = ds[0]["metadata"]["expression"]
    env = Calculator(2)
    env.reset(row, 0)
    observation = env.step(f"<calc>{expression}</calc>").observation
    value = observation.removeprefix("<result>").removesuffix("</result>")
    assert value == row["answer"]
    assert env.step(f"<answer>{value}</answer>") == StepResult("", 1.0, True)


# ----------------------------------------------------------------------------- builtin:reasoning_gym


def test_reasoning_gym_attempts_score_with_the_tasks_own_scorer():
    ds = rg_dataset("basic_arithmetic")
    row = row_of(Example(ds[1]["question"], str(ds[1]["answer"]), "basic_arithmetic", ds[1]))
    env = ReasoningGymAttempts(ds.score_answer, 3)
    assert env.reset(row, 0) == ""
    wrong = str(int(row["answer"]) + 1)
    assert env.step(wrong) == StepResult("<feedback>incorrect (score 0); try again</feedback>", None, False)
    assert env.step(f"<answer>{row['answer']}</answer>") == StepResult("", 1.0, True)
    env.reset(row, 0)
    assert [env.step(wrong).done for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="needs a reasoning-gym row"):
        env.reset(ADD_ROW, 0)


# ----------------------------------------------------------------------------- restore


@pytest.mark.parametrize("make, actions, probe", [
    (lambda: Guess(4), ["1", "hello", "100"], "0"),
    (lambda: Calculator(3), ["<calc>1+2</calc>", "<calc>2*3</calc>"], "<calc>9</calc>"),
])
def test_restore_reapplies_the_actions_and_the_next_step_is_the_live_envs(make, actions, probe):
    live = make()
    live.reset(ADD_ROW, 21)
    for a in actions:
        live.step(a)
    restored = restore(make, ADD_ROW, 21, actions)
    assert restored is not live and restored.__dict__ == live.__dict__
    expected = live.step(probe)
    assert expected.done  # the probe is the last turn: only an env that counted the replayed actions ends here
    assert restored.step(probe) == expected
    fresh = restore(make, ADD_ROW, 21, actions[:1])
    assert fresh.step(probe) != expected


def test_restore_calls_only_reset_and_step():
    calls = []

    class Recorder:
        def reset(self, row, seed):
            calls.append(("reset", row["answer"], seed))
            return ""

        def step(self, action):
            calls.append(("step", action))
            return StepResult("ok", None, False)

    env = restore(Recorder, ADD_ROW, 3, ["a", "b"])
    assert isinstance(env, Recorder) and calls == [("reset", "7", 3), ("step", "a"), ("step", "b")]


# ----------------------------------------------------------------------------- safe calls


class Faulty:
    def __init__(self, step_returns=None, raises=None, hang=None):
        self.step_returns, self.raises, self.hang = step_returns, raises, hang

    def reset(self, row, seed):
        return self.step(None)

    def step(self, action):
        if self.hang is not None:
            self.hang.wait(10)
        if self.raises is not None:
            raise self.raises
        return self.step_returns


@pytest.mark.parametrize("returns, reason", [
    ([1, 2], f"returned a list, not {STEP_FORMS}"),
    (None, f"returned a NoneType, not {STEP_FORMS}"),
    (("obs", 1.0), f"returned a tuple of 2, not {STEP_FORMS}"),
    (("obs", 1.0, False, {}), f"returned a tuple of 4, not {STEP_FORMS}"),
    ((3, None, False), "returned a 3-tuple whose observation is an int, not str"),
    (("", "1", True), "returned a 3-tuple whose reward is '1', not a finite number or None"),
    (("", 1.0, 1), "returned a 3-tuple whose done is an int, not bool"),
    (("", float("inf"), False, False, {}), "returned a 5-tuple whose reward is inf, not a finite number or None"),
    (("", 1.0, 0, False, {}), "returned a 5-tuple whose terminated is an int, not bool"),
    (("", 1.0, False, None, {}), "returned a 5-tuple whose truncated is a NoneType, not bool"),
    (("", 1.0, False, False, None), "returned a 5-tuple whose info is a NoneType, not dict"),
    (StepResult(3, None, False), "returned a StepResult whose observation is an int, not str"),
    (StepResult("", "1", True), "returned a StepResult whose reward is '1', not a finite number or None"),
    (StepResult("", float("nan"), True), "returned a StepResult whose reward is nan, not a finite number or None"),
    (StepResult("", True, True), "returned a StepResult whose reward is True, not a finite number or None"),
    (StepResult("", 1.0, 1), "returned a StepResult whose done is an int, not bool"),
])
def test_safe_step_names_a_wrong_return(returns, reason):
    assert safe_step(Faulty(step_returns=returns), "a", 5.0) == EnvFault(reason)


def test_safe_step_names_an_exception_and_passes_a_good_result_through():
    at = raised_at(__file__, "raise self.raises")  # where in the env's code: the innermost frame outside verlj
    assert safe_step(Faulty(raises=ValueError("bad action\nsecond line")), "a", 5.0) == EnvFault("raised ValueError: bad action" + at)
    assert str(safe_step(Faulty(raises=KeyError()), "a", 5.0)) == "raised KeyError" + at
    assert safe_step(Faulty(raises=SystemExit(3)), "a", 5.0) == EnvFault("raised SystemExit: 3" + at)
    good = StepResult("obs", 0.5, False)
    assert safe_step(Faulty(step_returns=good), "a", 5.0) is good
    as_float = safe_step(Faulty(step_returns=StepResult("", 1, True)), "a", 5.0)
    assert as_float == StepResult("", 1.0, True) and type(as_float.reward) is float


@pytest.mark.parametrize("returns, result", [
    (("obs", 1, False), StepResult("obs", 1.0, False)),
    (("obs", None, True), StepResult("obs", None, True)),
    (("", np.float32(0.5), np.bool_(True)), StepResult("", 0.5, True)),
    (("obs", 0.25, False, False, {"k": 1}), StepResult("obs", 0.25, False)),
    (("obs", 0.25, True, False, {}), StepResult("obs", 0.25, True)),
    (("obs", None, False, np.bool_(True), {}), StepResult("obs", None, True)),
])
def test_safe_step_takes_the_tuple_forms(returns, result):
    got = safe_step(Faulty(step_returns=returns), "a", 5.0)
    assert got == result and type(got.done) is bool and (got.reward is None or type(got.reward) is float)


def test_a_hung_env_is_a_fault_after_the_timeout_and_its_thread_is_abandoned():
    release = threading.Event()
    try:
        t = time.monotonic()
        assert safe_step(Faulty(hang=release), "a", 0.2) == EnvFault("no answer in 0.2 s")
        assert safe_reset(Faulty(hang=release), ADD_ROW, 0, 0.2) == EnvFault("no answer in 0.2 s")
        assert 0.4 <= time.monotonic() - t < 3
        stuck = [th for th in threading.enumerate() if th.name == "verlj-env"]
        assert len(stuck) == 2 and all(th.daemon for th in stuck)
    finally:
        release.set()


def test_safe_reset_names_faults_and_returns_the_observation():
    assert safe_reset(Faulty(step_returns=5), ADD_ROW, 0, 5.0) == EnvFault("returned an int, not str or (observation, info)")
    assert safe_reset(Faulty(step_returns=("obs", {"seed": 1})), ADD_ROW, 0, 5.0) == "obs"  # gymnasium's
    assert safe_reset(Faulty(step_returns=("obs", None)), ADD_ROW, 0, 5.0) == EnvFault(
        "returned a tuple of a str and a NoneType, not (observation str, info dict)")
    assert safe_reset(Faulty(step_returns=("obs", {}, 1)), ADD_ROW, 0, 5.0) == EnvFault(
        "returned a tuple, not str or (observation, info)")
    assert safe_reset(Faulty(raises=RuntimeError("no")), ADD_ROW, 0, 5.0) == EnvFault("raised RuntimeError: no" + raised_at(__file__, "raise self.raises"))
    assert safe_reset(Guess(2), ADD_ROW, 0, 5.0).startswith("Guess a whole number")
    assert safe_reset(Calculator(2), ADD_ROW, 0, 5.0) == ""


# ----------------------------------------------------------------------------- loading


def test_load_env_makes_the_builtins_with_max_turns():
    assert load_env(Config()) is None
    calc = load_env(cfg_with("builtin:calculator", 5))()
    guess = load_env(cfg_with("builtin:guess", 6))()
    rg = load_env(cfg_with("builtin:reasoning_gym", 2, "reasoning_gym:basic_arithmetic"))()
    assert (type(calc), calc.max_turns, type(guess), guess.max_turns) == (Calculator, 5, Guess, 6)
    assert isinstance(rg, ReasoningGymAttempts) and rg.max_turns == 2
    factory = load_env(cfg_with("builtin:guess"))
    assert factory() is not factory()  # one env per episode


USER_ENVS = '''
from verlj.engine.rl.envs import StepResult

class Echo:
    def reset(self, row, seed):
        return row["prompt"]
    def step(self, action):
        return StepResult(action.upper(), 1.0, True)

class Broken:
    def __init__(self):
        raise OSError("no sandbox here")

class NotAnEnv:
    def reset(self, row, seed):
        return ""

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "user_envs_mod.py").write_text(USER_ENVS)
    (tmp_path / "user_envs_broken.py").write_text("raise RuntimeError('half-written module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_users_env_loads_by_module_and_class(user_envs):
    env = load_env(cfg_with("user_envs_mod:Echo"))()
    assert env.reset(ADD_ROW, 0) == "3+4=" and env.step("done") == StepResult("DONE", 1.0, True)
    envs.check_env(cfg_with("user_envs_mod:Echo"))


@pytest.mark.parametrize("spec, message", [
    ("builtin:chess", "rollout.env: unknown built-in 'builtin:chess'; known: builtin:calculator, builtin:equals, builtin:guess, builtin:reasoning_gym"),
    ("no_such_module_xyz:Env", "rollout.env: cannot import 'no_such_module_xyz:Env' (No module named 'no_such_module_xyz')"),
    ("user_envs_mod:Missing", "rollout.env: cannot import 'user_envs_mod:Missing' (module 'user_envs_mod' has no 'Missing')"),
    ("user_envs_broken:Env", "rollout.env: importing module 'user_envs_broken' failed: RuntimeError: half-written module"),
    ("user_envs_mod:NOT_CALLABLE", "rollout.env: 'user_envs_mod:NOT_CALLABLE' is an int, not a class or function that makes an Environment"),
    ("user_envs_mod:Broken", "rollout.env: making user_envs_mod:Broken failed: OSError: no sandbox here"),
    ("user_envs_mod:NotAnEnv", "rollout.env: user_envs_mod:NotAnEnv made a NotAnEnv, which is not an Environment"),
    ("user_envs_mod:NotAnEnv", "; a TRL environment_factory class is named trl:user_envs_mod:NotAnEnv"),  # it has a reset
    ("builtin:reasoning_gym", "rollout.env=builtin:reasoning_gym answers reasoning-gym rows: it needs data.train_dataset=reasoning_gym:TASK"),
])
def test_an_env_that_cannot_be_loaded_is_one_config_error(user_envs, spec, message):
    with pytest.raises(ConfigError) as e:
        envs.check_env(cfg_with(spec))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_env_keys_resume_policy():
    # env and max_turns change what a step generates, as reward_fn and max_response_length do: live (replay reads
    # the journaled episodes and never calls an env); the timeout only says when a call has failed: bookkeeping
    assert (policy_of("rollout.env"), policy_of("rollout.max_turns"), policy_of("rollout.env_timeout_s")) == ("live", "live", "bookkeeping")
    assert policy_of("rollout.reward_fn") == policy_of("rollout.max_response_length") == "live"


def _group(turns_per_episode: list[int], versions: list[int]):
    """A durable group whose episode k took turns_per_episode[k] turns (action 2 tokens, observation 1)."""
    import numpy as np

    from verlj.engine.schema.sample import EnvEnd, GroupInFlight

    eps = []
    for k, t in enumerate(turns_per_episode):
        resp = np.arange(3 * t, dtype=np.int64) + 10 * k
        eps.append(dict(response_ids=resp, gen_logprobs=np.where(np.arange(3 * t) % 3 < 2, -0.5, 0.0).astype(np.float32),
                        loss_mask=(np.arange(3 * t) % 3 < 2).astype(np.int8), turn_lens=np.tile([2, 1], t).astype(np.int64),
                        turn_rewards=np.full(t, np.nan), env_end=int(EnvEnd.DONE if t < len(versions) else EnvEnd.NONE)))
    cols = {name: [e[name] for e in eps] for name in eps[0]}
    return GroupInFlight(8, 3, versions, prompt_ids=[np.array([1, 2])] * len(eps), env_seed=list(range(len(eps))),
                         env_reason=[""] * len(eps), **cols)


def test_a_durable_group_cut_before_a_turn_goes_on_from_there():
    from verlj.engine.schema.sample import EnvEnd, GroupInFlight

    g = _group([1, 3, 2], versions=[0, 0, 1])  # episode 0 ended at turn 1, episode 2 at turn 2, episode 1 goes on
    assert g.turn == 3 and g.turns_durable == 6 and g.live == 1
    assert GroupInFlight.from_dict(g.to_dict()).to_dict().keys() == g.to_dict().keys()
    assert g.before(3) is g and g.before(0) is None
    cut = g.before(2)
    assert cut.versions == [0, 0] and cut.turn == 2
    assert [len(t) // 2 for t in cut.turn_lens] == [1, 2, 2] and cut.env_end == [EnvEnd.DONE, EnvEnd.NONE, EnvEnd.DONE]
    assert [len(r) for r in cut.response_ids] == [3, 6, 6] and (cut.response_ids[1] == g.response_ids[1][:6]).all()
    cut1 = g.before(1)
    assert cut1.env_end == [EnvEnd.DONE, EnvEnd.NONE, EnvEnd.NONE] and [len(r) for r in cut1.turn_rewards] == [1, 1, 1]


def test_a_round_restored_from_its_durable_state_reapplies_its_actions_to_fresh_envs():
    """Every live episode's env reset with its seed and its actions stepped in order; its observations are
    the durable ones, whatever the env says now; an episode over gets no env; a fault on the way ends it."""
    from verlj.engine.rl.episodes import Limits, Round
    from verlj.engine.schema.sample import EnvEnd

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ",".join(str(int(i)) for i in ids)

    calls = []

    class Env:
        def reset(self, row, seed):
            calls.append(("reset", seed))
            return "new obs"

        def step(self, action):
            calls.append(("step", action))
            if action.startswith("2"):  # episode 2's first action: the env falls over this time
                raise OSError("gone")
            return StepResult("another observation", 1.0, False)

    g = _group([1, 3, 2], versions=[0, 0, 1])
    g.env_end[2] = int(EnvEnd.NONE)  # episode 2 goes on too
    rnd, replayed = Round.restored(Env, [{}] * 3, g, Tok(), Limits(max_turns=4, timeout_s=5.0))
    assert calls == [("reset", 1), ("step", "10,11"), ("step", "13,14"), ("step", "16,17"), ("reset", 2), ("step", "20,21")]
    assert replayed == 4 and rnd.turn == 3
    assert [ep.live for ep in rnd.episodes] == [False, True, False]
    assert rnd.episodes[2].reason == "restore: step raised OSError: gone" + raised_at(__file__, 'raise OSError("gone")')
    assert rnd.episodes[1].response == g.response_ids[1].tolist() and rnd.live() == [1]


# ----------------------------------------------------------------------------- builtin:equals


def test_equals_presses_the_key_on_the_question_then_scores_the_answer():
    env = Equals(2)
    # '=' anywhere in an action asks the calculator for the question's value (the prompt less its '='): 0.1 for the press
    assert episode(env, ADD_ROW, 1, ["=", "7"]) == ["", StepResult("7", 0.1, False), StepResult("", 1.0, True)]
    assert episode(env, row_of(Example("12*3=", "36")), 1, ["5=", "36"])[1:] == [StepResult("36", 0.1, False), StepResult("", 1.0, True)]
    # a final answer at once: 1.0 when right, else 0.0
    assert episode(env, ADD_ROW, 1, ["+7"])[1] == StepResult("", 1.0, True)
    assert episode(env, ADD_ROW, 1, ["8"])[1] == StepResult("", 0.0, True)
    assert episode(env, ADD_ROW, 1, ["7 7"])[1] == StepResult("", 0.0, True)
    # a key press as the last action scores 0.0; a question that is no arithmetic reads "error"
    assert episode(env, ADD_ROW, 1, ["=", "="])[2] == StepResult("", 0.0, True)
    assert episode(Equals(3), row_of(Example("what?", "1")), 1, ["="])[1] == StepResult("error", 0.1, False)
    with pytest.raises(RuntimeError):
        env.step("7")  # the episode is over
    factory = load_env(cfg_with("builtin:equals", max_turns=2))
    assert isinstance(factory(), Equals) and factory().max_turns == 2


# ----------------------------------------------------------------------------- bounded episodes (rl.episodes.Round)


class Talker:
    """Answers every action with `obs` (a reward of 1.0), after `wait` seconds; reset's observation `first`."""

    def __init__(self, obs="ok", first="", wait=0.0):
        self.obs, self.first, self.wait = obs, first, wait

    def reset(self, row, seed):
        return self.first

    def step(self, action):
        time.sleep(self.wait)
        return self.obs, 1.0, False


def a_round(env, n=2, **limits):
    from verlj.engine.rl.episodes import Limits, Round

    return Round(lambda: env, [{}] * n, list(range(n)), [np.array([1, 2])] * n, CharTok(), Limits(**{"max_turns": 4, "timeout_s": 5.0, **limits}))


def test_an_observation_is_capped_in_tokens_and_marked():
    from verlj.engine.rl.episodes import TRUNCATED

    rnd = a_round(Talker(obs="x" * 1_000_000, first="y" * 100), max_observation=20)
    assert len(rnd.episodes[0].prompt_ids) == 2 + 20 and CharTok().decode(rnd.episodes[0].prompt_ids[2:]).endswith(TRUNCATED)
    rnd.take([0, 1], [np.array([65, 66])] * 2, [np.zeros(2, np.float32)] * 2)
    ep = rnd.episodes[0]
    assert ep.turn_lens == [2, 20] and CharTok().decode(ep.response[2:]) == "x" * (20 - len(TRUNCATED)) + TRUNCATED
    assert ep.live and ep.mask == [1, 1] + [0] * 20
    short = a_round(Talker(obs="short"), max_observation=20)
    short.take([0], [np.array([65])], [np.zeros(1, np.float32)])
    assert CharTok().decode(short.episodes[0].response[1:]) == "short"


def test_an_episode_ends_by_length_before_its_context_passes_the_limit():
    from verlj.engine.schema.sample import EnvEnd

    rnd = a_round(Talker(obs="o" * 10), max_length=20, max_action=4)  # prompt 2 + action 2 + observation 10 = 14: room for 4 more
    rnd.take([0, 1], [np.array([65, 66])] * 2, [np.zeros(2, np.float32)] * 2)
    assert [ep.live for ep in rnd.episodes] == [True, True]
    rnd.take([0, 1], [np.array([65, 66])] * 2, [np.zeros(2, np.float32)] * 2)  # 16 + an observation cut to the 4 left
    ep = rnd.episodes[0]
    assert ep.end == EnvEnd.LENGTH and ep.reason == "" and len(ep.prompt_ids) + len(ep.response) == 20 and ep.turn_lens[-1] == 4


def test_an_action_that_is_only_eos_ends_the_episode_without_a_step():
    from verlj.engine.schema.sample import EnvEnd

    rnd = a_round(Talker())
    rnd.take([0, 1], [np.array([0]), np.array([65, 0])], [np.zeros(1, np.float32), np.zeros(2, np.float32)])
    assert rnd.episodes[0].end == EnvEnd.STOPPED and rnd.episodes[0].turn_lens == [1, 0] and np.isnan(rnd.episodes[0].turn_rewards[0])
    assert rnd.episodes[1].live and rnd.episodes[1].turn_rewards == [1.0]


def test_the_envs_of_a_turn_are_stepped_at_once():
    """Eight envs that each take 0.3 s (or hang past the timeout) cost one wait, not eight."""
    t = time.monotonic()
    rnd = a_round(Talker(wait=0.3), n=8)
    rnd.take(list(range(8)), [np.array([65])] * 8, [np.zeros(1, np.float32)] * 8)
    assert time.monotonic() - t < 1.2 and all(ep.live and ep.turn_rewards == [1.0] for ep in rnd.episodes)
    t = time.monotonic()
    hung = a_round(Talker(wait=3.0), n=8, timeout_s=0.3)
    hung.take(list(range(8)), [np.array([65])] * 8, [np.zeros(1, np.float32)] * 8)
    assert time.monotonic() - t < 1.2 and all(ep.reason == "step no answer in 0.3 s" for ep in hung.episodes)


def test_a_group_played_beside_generation_goes_on_from_its_state_on_another_actor():
    """rl.episodes.play_group (a fleet's actor): a group's turn 2 played by an actor that did not hold it
    (its envs restored from the state turn 1 left, the actions re-applied) answers exactly what the actor
    that played turn 1, holding its live envs, answers."""
    from verlj.engine.rl.episodes import GroupWork, Limits, play_group
    from verlj.engine.rl.models import load_tokenizer

    cfg = cfg_with("builtin:guess")
    tok = load_tokenizer(cfg.model.actor.model_name_or_path, cfg=cfg)
    factory = envs.load_env(cfg)

    def generate(prompts, seeds):  # an action from each seed alone: a guess between 0 and 99
        return [np.asarray(tok(str(s % 100), add_special_tokens=False).input_ids) for s in seeds], \
               [np.zeros(len(tok(str(s % 100), add_special_tokens=False).input_ids), np.float32) for s in seeds]

    rows = [{"prompt": "p", "answer": ""}] * 3
    work = GroupWork(7, 0, rows, [np.asarray([1, 2])] * 3, [11, 12, 13], [(5, 0, "g", 7, j) for j in range(3)], Limits(3, 5.0), 1)
    held_a: dict = {}
    first = play_group(work, factory, tok, generate, 1, held_a)
    assert 7 in held_a and len(first["versions"]) == 1
    work.state = first
    on_a = play_group(work, factory, tok, generate, 2, held_a)
    on_b = play_group(work, factory, tok, generate, 2, {})
    assert on_a["versions"] == on_b["versions"] == [1, 2]
    for key in ("response_ids", "turn_lens", "turn_rewards", "env_end", "env_reason"):
        assert [np.asarray(x).tobytes() for x in on_a[key]] == [np.asarray(x).tobytes() for x in on_b[key]], key
    assert any(len(t) == 4 for t in on_a["turn_lens"])  # some episode took both turns


def test_the_longest_sequence_bounds_every_context_an_episode_generates_from():
    """rl.episodes.longest_sequence (what a vLLM engine is sized to): a prompt and its response; with
    rollout.env the prompt and max_turns actions and capped observations, or rollout.max_episode_length."""
    from verlj.engine.config import make_config
    from verlj.engine.rl.episodes import longest_sequence

    base = ["data.max_prompt_length=64", "rollout.max_response_length=8"]
    assert longest_sequence(make_config(None, base), 80) == 72
    env = [*base, "rollout.env=builtin:guess", "rollout.max_turns=3", "rollout.max_observation_length=16"]
    assert longest_sequence(make_config(None, env), 80) == 64 + 3 * (8 + 16)
    assert longest_sequence(make_config(None, [*env, "rollout.max_episode_length=100"]), 80) == 100
    assert longest_sequence(make_config(None, [*env, "rollout.max_episode_length=50"]), 80) == 72 + 16  # the first action
    assert longest_sequence(make_config(None, [*env, "rollout.max_observation_length=0"]), 4096) == 4096  # uncapped: the model's
    agent = [*base, "rollout.agent=examples.tool_agent:solve", "rollout.max_turns=2"]  # a call's whole conversation
    assert longest_sequence(make_config(None, agent), 4096) == 4096
    assert longest_sequence(make_config(None, [*agent, "rollout.max_episode_length=300"]), 4096) == 300
    assert longest_sequence(make_config(None, agent), 80) == 2048  # the built-in model states only the single-turn bound


def test_an_observation_the_vocabulary_cannot_spell_is_said_once(capsys, monkeypatch):
    """The built-in digits vocabulary and an env that writes words: one [WARNING] line naming the fix,
    not a run that trains on <unk> with a healthy-looking log; digits alone say nothing."""
    from verlj.engine.rl import episodes
    from verlj.engine.rl.models import load_tokenizer

    monkeypatch.setattr(episodes, "_WARNED", [])
    cfg = cfg_with("builtin:guess")
    tok = load_tokenizer(cfg.model.actor.model_name_or_path, cfg=cfg)  # the default dataset's digits vocabulary
    enc = lambda text: np.asarray(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    episodes._warn_unknown(tok, "12+3", enc("12+3"))
    assert capsys.readouterr().err == ""
    for _ in range(2):
        episodes._warn_unknown(tok, "You are at 0.", enc("You are at 0."))
    err = capsys.readouterr().err
    assert err.count("[WARNING]") == 1 and "'You are at 0.'" in err and "model.tiny.vocab=ascii" in err
