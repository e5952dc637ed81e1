"""The rollout seam (engine/rl/sources): the config chooses the source and its player, assembled in one place, and
what recovery asks of a source (a journaled step's buffer changes, what waits after it) needs no model, no engine, no
run."""

from types import SimpleNamespace

import numpy as np
import pytest

from verlj.engine.config import make_config
from verlj.engine.rl.buffer import RolloutBuffer
from verlj.engine.rl.inputs import StepInputs
from verlj.engine.rl.sources import Parts, make_source, order_of, player_of
from verlj.engine.rl.sources.agent_groups import AgentGroups
from verlj.engine.rl.sources.agent_players import AgentRounds
from verlj.engine.rl.sources.completion import CompletionSource
from verlj.engine.rl.sources.env_players import EnvRounds, Turns
from verlj.engine.rl.sources.planned import PlannedSource
from verlj.engine.rl.sources.single import SingleTurn, SingleTurnGroups
from verlj.engine.rl.sources.sync import SyncSource
from verlj.engine.schema import events as ev
from verlj.engine.schema.sample import Sample, pack

ASYNC = ["rollout.mode=async"]
COMPLETION = [*ASYNC, "rollout.async_order=completion"]


def parts(*overrides: str) -> Parts:
    """What a source and its player are made of, less what only a live collect reads (models, the sampler, the data)."""
    actor = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace()))
    return Parts(make_config(None, ["rollout.n=2", *overrides]), SimpleNamespace(dp_size=1, dp_rank=0, world_size=1),
                 SimpleNamespace(eos_token_id=2), [], [], RolloutBuffer(), None, None, actor, lambda: None)


@pytest.mark.parametrize("overrides, order, kind, cls, player", [
    ([], "sync", "single", SyncSource, SingleTurn), (ASYNC, "planned", "single", PlannedSource, SingleTurn),
    ([*ASYNC, "rollout.async_order=step"], "planned", "single", PlannedSource, SingleTurn),
    (["rollout.env=builtin:guess", "rollout.max_turns=2"], "sync", "env", SyncSource, EnvRounds),
    (COMPLETION, "completion", "single", CompletionSource, SingleTurnGroups),
    ([*COMPLETION, "rollout.env=builtin:guess", "rollout.max_turns=2"], "completion", "env", CompletionSource, Turns),
    (["rollout.agent=m:f", "rollout.max_turns=2"], "sync", "agent", SyncSource, AgentRounds),
    ([*ASYNC, "rollout.agent=m:f"], "planned", "agent", PlannedSource, AgentRounds),
    ([*COMPLETION, "rollout.agent=m:f"], "completion", "agent", CompletionSource, AgentGroups)])
def test_the_config_chooses_the_source_and_its_player_once(overrides, order, kind, cls, player):
    p = parts(*overrides)
    assert (order_of(p.cfg), player_of(p.cfg)) == (order, kind)
    source = make_source(p)
    assert type(source) is cls and source.engine is None  # no engine until a live collect: replay never builds one
    # the one player the config names, made with the source (step order's batches hold it; completion order asks it)
    assert type(source.player if isinstance(source, CompletionSource) else source.batches.player) is player


def group(first: int, scores: list[float], version: int = 0) -> list[Sample]:
    return [Sample(index=3, prompt_ids=np.array([1, 2]), response_ids=np.array([5, 6 + j]), gen_logprobs=np.zeros(2, np.float32),
                   id=first + j, group=first, score=s, policy_version=version) for j, s in enumerate(scores)]


def inputs(added: list[Sample], dropped=(), stale=(), plans=None, requests=None) -> StepInputs:
    ids = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    return StepInputs(seeds={}, data=ev.Data(0, 0, ids([]), 1), added=pack(added), dropped=ids(dropped), consumed=ids([]),
                      rollout=ev.Rollout("hf", None), stale=ids(stale), plans=plans or {}, requests=requests)


def test_a_step_order_replay_puts_back_the_samples_the_drops_and_the_plans():
    h = parts(*ASYNC)
    source = make_source(h)
    source.replayed(inputs(group(0, [1.0, 0.0]) + group(2, [1.0, 1.0]), dropped=[2, 3], plans={3: np.array([0, 1])}))
    assert sorted(h.buffer.samples) == [0, 1] and h.buffer.next_id == 4
    assert list(h.buffer.plans) == [3] and h.buffer.plans[3].tolist() == [0, 1]
    assert source.in_flight() == {"buffer/pending": 2.0}


def test_a_completion_order_replay_puts_back_the_groups_asked_and_not_arrived():
    """The requests a step journaled are what a resumed process asks again: replay must leave them in
    the buffer (less the groups that arrived), and the step's metrics count them."""
    h = parts(*COMPLETION)
    source = make_source(h)
    asked = ev.Requests(np.array([0, 2, 4]), np.array([3, 5, 7]), np.zeros(0, np.int64))
    source.replayed(inputs(group(0, [1.0, 0.0]), requests=asked))
    assert h.buffer.requests == {2: 5, 4: 7} and sorted(h.buffer.samples) == [0, 1] and h.buffer.next_id == 6
    assert source.in_flight() == {"buffer/pending": 2.0, "buffer/requested_groups": 2.0}
    # a step-order source reads no requests: the seam, not the record, decides what is brought back
    planned = parts(*ASYNC)
    make_source(planned).replayed(inputs(group(0, [1.0, 0.0]), requests=asked))
    assert planned.buffer.requests == {}
