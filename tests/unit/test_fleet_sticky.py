"""The fleet's queue with rollout.agent (rl.fleet.RayFleet._take): an episode's calls go to the actor that took its
first, while that actor is alive; the others take what no live actor keeps."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from verlj.engine.rl.fleet import RayFleet


def fleet(items: list[tuple], chunk: int = 2) -> RayFleet:
    f = RayFleet.__new__(RayFleet)  # only the queue's state: no Ray, no actors
    f._queue, f._sticks, f._chunk = deque(items), {}, chunk
    f.slots = [SimpleNamespace(alive=True), SimpleNamespace(alive=True)]
    return f


def item(q: int, episode: str | None) -> tuple:
    return (1, q, (None, [q]), {}, episode) if episode is not None else (1, q, (None, [q]), {})


def test_an_episodes_calls_go_to_the_actor_that_took_its_first_while_it_lives():
    f = fleet([item(0, "a"), item(1, "b")])
    assert [it[1] for it in f._take(0)] == [0, 1]  # actor 0 takes episodes a and b
    f._queue.extend([item(2, "a"), item(3, "c"), item(4, "b"), item(5, None)])
    assert [it[1] for it in f._take(1)] == [3, 5]  # actor 1 passes over a's and b's calls: actor 0 keeps them
    assert [it[1] for it in f._queue] == [2, 4]  # kept in line, in order
    f.slots[0].alive = False  # actor 0 died: its episodes go to whichever actor takes their next call
    assert [it[1] for it in f._take(1)] == [2, 4] and f._sticks == {"a": 1, "b": 1, "c": 1}


def test_groups_without_an_episode_are_taken_in_order_up_to_the_chunk():
    f = fleet([item(q, None) for q in range(5)], chunk=3)
    assert [it[1] for it in f._take(1)] == [0, 1, 2] and [it[1] for it in f._take(0)] == [3, 4] and not f._sticks
