"""An env's state() journaled per turn (the sample's env_states): reset's first, then one after each step it answered,
each canonical JSON; none for an env without state(), a single-turn sample, or a journal from before the column; a
state() that raises, hangs, or returns what is not a dict of JSON is the episode's fault; completion order carries the
states in its durable group (restored, never asked again of the fresh env) and cuts them with the group."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from envs_for_tests import CharTok

from verlj.engine.rl.envs import EnvFault, StepResult, has_state, safe_states
from verlj.engine.rl.episodes import Limits, Round
from verlj.engine.schema.sample import EnvEnd, GroupInFlight, Sample, pack, state_text, state_texts, states_text, unpack


class Counter:
    """Counts its steps; done at the `last`-th. Its state: the seed, the steps so far, the actions (a list), a float."""

    calls: list = []  # every state() asked, across instances

    def __init__(self, last=2, bad=None):
        self.last, self.bad = last, bad

    def reset(self, row, seed):
        self.seed, self.actions = seed, []
        return "go"

    def step(self, action):
        self.actions.append(action)
        return StepResult(f"n={len(self.actions)}", 1.0 if len(self.actions) == self.last else None, len(self.actions) == self.last)

    def state(self):
        Counter.calls.append(self.seed)
        if self.bad is not None and len(self.actions) >= self.bad[0]:
            return self.bad[1]()
        return {"seed": self.seed, "steps": len(self.actions), "actions": list(self.actions), "half": 0.5}


class Stateless:
    state = "an attribute, not a method"  # never called

    def reset(self, row, seed):
        return ""

    def step(self, action):
        return "", 0.0, True


def a_round(make, n=2, **limits):
    return Round(make, [{}] * n, [7 + k for k in range(n)], [np.array([1, 2])] * n, CharTok(),
                 Limits(**{"max_turns": 4, "timeout_s": 5.0, **limits}))


def act(rnd, places, text="A"):
    rnd.take(places, [np.array([ord(c) for c in text])] * len(places), [np.zeros(len(text), np.float32)] * len(places))


def test_an_env_with_state_journals_resets_then_each_steps_state_as_canonical_json():
    rnd = a_round(Counter)
    act(rnd, [0, 1], "A")
    act(rnd, [0, 1], "B")  # the second step says done: its state is asked still (the env dropped by then)
    f = rnd.fields(0)
    assert f["env_end"] == EnvEnd.DONE
    assert json.loads(f["env_states"]) == [{"seed": 7, "steps": n, "actions": ["A", "B"][:n], "half": 0.5} for n in range(3)]
    assert f["env_states"].startswith('[{"actions":[],"half":0.5,"seed":7,"steps":0},')  # keys sorted, no spaces
    assert json.loads(rnd.fields(1)["env_states"])[0]["seed"] == 8
    assert state_texts(f["env_states"]) == [state_text(s) for s in json.loads(f["env_states"])]
    assert states_text(state_texts(f["env_states"])) == f["env_states"]


def test_an_env_without_state_and_a_single_turn_sample_journal_none():
    assert not has_state(Stateless()) and has_state(Counter())
    rnd = a_round(Stateless)
    act(rnd, [0, 1])
    assert rnd.fields(0)["env_states"] == "" and rnd.fields(0)["env_end"] == EnvEnd.DONE
    assert rnd.state(0, 0, [1]).env_states == []  # a group of no state: its durable map as before
    assert "env_states" not in rnd.state(0, 0, [1]).to_dict()
    assert Sample(index=0, prompt_ids=np.zeros(1), response_ids=np.zeros(1), gen_logprobs=np.zeros(1, np.float32)).env_states == ""


def test_the_column_round_trips_and_a_batch_without_it_keeps_its_bytes():
    def sample(states):
        return Sample(index=0, prompt_ids=np.array([1]), response_ids=np.array([2, 3]), gen_logprobs=np.zeros(2, np.float32),
                      env_end=int(EnvEnd.DONE), loss_mask=np.array([1, 0], np.int8), turn_lens=np.array([1, 1]),
                      turn_rewards=np.array([1.0]), env_states=states)

    text = states_text([state_text({"b": 1, "a": [1.5, None]}), state_text({"a": "é"})])
    assert text == '[{"a":[1.5,null],"b":1},{"a":"é"}]'
    cols = pack([sample(text), sample("")])
    assert cols["env_states"] == [text, ""]
    assert [s.env_states for s in unpack(cols)] == [text, ""]
    assert all(a.same_as(b) for a, b in zip(unpack(cols), [sample(text), sample("")]))
    plain = pack([sample(""), sample("")])
    assert "env_states" not in plain  # no state anywhere: the batch is what it was before the column existed
    old = {k: v for k, v in cols.items() if k != "env_states"}  # a journal written before it
    assert [s.env_states for s in unpack(old)] == ["", ""]


def boom():
    raise ValueError("no state here")


@pytest.mark.parametrize(("bad", "reason"), [
    (boom, "state raised ValueError: no state here (at test_env_states.py:"),
    (lambda: [1, 2], "state returned a list, not a dict"),
    (lambda: {"s": {1, 2}}, "state returned a dict that is not JSON (Object of type set is not JSON serializable)"),
    (lambda: {"x": float("nan")}, "state returned a dict that is not JSON (Out of range float values are not JSON compliant"),
])
def test_a_state_that_raises_or_is_no_dict_of_json_is_the_episodes_fault(bad, reason):
    rnd = a_round(lambda: Counter(last=3, bad=(1, bad)), n=1)
    act(rnd, [0])
    ep = rnd.episodes[0]
    assert ep.end == EnvEnd.FAULT and ep.reason.startswith(reason), ep.reason
    assert ep.turn_lens == [1, 3] and np.isnan(ep.turn_rewards[0])  # the step's answer stays: "n=1", no reward
    assert len(json.loads(rnd.fields(0)["env_states"])) == 1  # reset's; none for the turn that faulted
    at_reset = a_round(lambda: Counter(bad=(0, bad)), n=1)  # at reset: an episode of no turn
    assert at_reset.episodes[0].end == EnvEnd.FAULT and at_reset.episodes[0].reason.startswith(reason)
    assert at_reset.live() == [] and at_reset.fields(0)["env_states"] == ""


def test_a_state_that_hangs_is_a_fault_after_the_timeout():
    class Slow(Counter):
        def state(self):
            time.sleep(3.0)
            return {}

    t = time.monotonic()
    got = safe_states([Slow(), Slow(), Slow()], 0.3)
    assert got == [EnvFault("no answer in 0.3 s")] * 3 and time.monotonic() - t < 1.2
    rnd = a_round(Slow, n=2, timeout_s=0.3)
    assert [ep.reason for ep in rnd.episodes] == ["state no answer in 0.3 s"] * 2


def test_completion_order_carries_the_states_in_its_durable_group():
    """Round.state makes them durable; Round.restored brings them back without asking the fresh env (its actions
    re-applied, the states the journal holds); the next turn's state follows; a group cut before a turn cuts them."""
    rnd = a_round(lambda: Counter(last=4))
    act(rnd, [0, 1], "A")
    group = GroupInFlight.from_dict(rnd.state(3, 0, [1]).to_dict())
    assert [len(state_texts(t)) for t in group.env_states] == [2, 2]
    Counter.calls.clear()
    back, replayed = Round.restored(lambda: Counter(last=4), [{}] * 2, group, CharTok(), Limits(4, 5.0))
    assert replayed == 2 and Counter.calls == []  # the states are the durable ones
    act(back, [0, 1], "B")
    act(rnd, [0, 1], "B")
    assert back.fields(0)["env_states"] == rnd.fields(0)["env_states"] and len(state_texts(back.fields(1)["env_states"])) == 3
    two = GroupInFlight.from_dict(back.state(3, 0, [1, 2]).to_dict())
    assert two.before(1).env_states == group.env_states and two.before(2) is two
    assert GroupInFlight.from_dict({k: v for k, v in two.to_dict().items() if k != "env_states"}).env_states == []  # a map from before


def test_inspect_shows_the_reset_state_then_each_turns():
    from verlj.engine.post_mortem.inspection import EpisodeLine

    rnd = a_round(Counter, n=1)
    act(rnd, [0], "A")
    act(rnd, [0], "\x00")  # only end-of-sequence: no step, no state
    line = EpisodeLine.of(Sample(index=0, **rnd.fields(0)), None)
    assert line.reset_state == {"actions": [], "half": 0.5, "seed": 7, "steps": 0}
    assert [t.state for t in line.turns] == [{"actions": ["A"], "half": 0.5, "seed": 7, "steps": 1}, None]
    shown = line.to_json()
    assert shown["reset_state"] == line.reset_state and "state" not in shown["turns"][1] and shown["turns"][0]["state"]["steps"] == 1
    plain = EpisodeLine.of(Sample(index=0, **a_round(Stateless, n=1).fields(0)), None).to_json()
    assert "reset_state" not in plain


def test_a_fleets_actor_journals_the_same_states_holding_the_group_or_restoring_it():
    """rl.episodes.play_group: turn 2 on the actor that played turn 1 (its envs live) and on one that did not (fresh envs,
    the actions re-applied, the durable states carried) gives the same states."""
    from verlj.engine.rl.episodes import GroupWork, play_group

    def generate(prompts, seeds):
        return [np.array([65 + s % 3]) for s in seeds], [np.zeros(1, np.float32) for _ in seeds]

    work = GroupWork(7, 0, [{}] * 2, [np.array([1, 2])] * 2, [11, 12], [(5, 0, "g", 7, j) for j in range(2)], Limits(3, 5.0), 1)
    held: dict = {}
    work.state = play_group(work, lambda: Counter(last=3), CharTok(), generate, 1, held)
    assert [len(state_texts(t)) for t in work.state["env_states"]] == [2, 2]
    on_a = play_group(work, lambda: Counter(last=3), CharTok(), generate, 2, held)
    on_b = play_group(work, lambda: Counter(last=3), CharTok(), generate, 2, {})
    assert on_a["env_states"] == on_b["env_states"] and [len(state_texts(t)) for t in on_a["env_states"]] == [3, 3]
