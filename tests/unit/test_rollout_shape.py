"""The rollout wing keeps its shape (engine/rl/sources): a player is given what it needs when it is made and never
reaches into its source or the trainer; no module of the wing imports another in a circle (type-only imports too); and
what becomes durable reaches the journal's pending store in at most four hops from where it is made, the same way for
every kind (a model call, a turn, a generation a push stopped).

    python -m pytest -n 0 tests/unit/test_rollout_shape.py
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "engine" / "rl" / "sources"
OWNERS = {"src", "host", "trainer", "owner"}  # what a player would call its source or the trainer


def reaches(path: Path) -> list[str]:
    """'line name' for every name, parameter or attribute of `self` that would hold a source or the trainer (sorted)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            name = node.attr if isinstance(node.value, ast.Name) and node.value.id == "self" else None
        else:
            name = node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg) else None
        if name in OWNERS:
            out.append((node.lineno, name))
    return [f"{line} {name}" for line, name in sorted(out)]


def test_no_player_or_source_reaches_through_its_owner_or_the_trainer():
    """0 reaches: a player takes its parts (sources.players.Parts) and a small context per call, and returns what it made;
    a source holds the rollout's parts, not the trainer."""
    modules = sorted(SOURCES.glob("*.py"))
    assert len(modules) >= 10  # it looked where the wing is
    found = {p.name: r for p in modules if (r := reaches(p))}
    assert not found, f"reaches through a source or the trainer: {found}"


def test_the_count_finds_a_reach(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class P:\n    def __init__(self, src):\n        self.src = src\n\n    def f(self):\n        return self.src.cfg\n")
    assert reaches(f) == ["2 src", "3 src", "3 src", "6 src"]


def imports(path: Path) -> set[str]:
    """The modules of the same package `path` imports (relative imports of level 1), anywhere in it: TYPE_CHECKING
    blocks and function bodies included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (its modules in order), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_of_the_wing_imports_another_in_a_circle():
    graph = {p.stem: imports(p) - {p.stem} for p in SOURCES.glob("*.py") if p.stem != "__init__"}
    assert "players" in graph and not graph["players"] & set(graph), graph["players"]  # the protocols import no player
    assert circle(graph) is None, f"an import circle in engine/rl/sources: {' -> '.join(circle(graph) or [])}"
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one


# ----------------------------------------------------------------------------- the durable path, measured on the real objects


def hops(frames: list[inspect.FrameInfo], origin: str) -> list[str]:
    """The objects a durable write passed through on its way to the journal's pending store (`frames`: the callers of
    Pending.put, innermost first), from the method that made it (`origin`, excluded): each frame's object's class and
    method, in order, then Pending.put itself; the ranks' transport (Runtime.from_rank0, and the closure it runs on rank
    0) left out."""
    out: list[str] = []
    for fi in reversed(frames):
        me = fi.frame.f_locals.get("self")
        if me is None or type(me).__name__ == "Runtime" or not hasattr(type(me), fi.function):  # the transport, a closure
            continue
        name = f"{type(me).__name__}.{fi.function}"
        if name == origin:
            out = []
        elif not out or out[-1] != name:
            out.append(name)
    return [*out, "Pending.put"]


def watch_puts(monkeypatch) -> list[list[inspect.FrameInfo]]:
    """The callers of every Pending.put from now on, innermost first (each write's own stack)."""
    from verlj.journal.pending import Pending

    stacks: list[list[inspect.FrameInfo]] = []
    put = Pending.put

    def watched(self, *args, **kwargs):
        stacks.append(inspect.stack()[1:])
        return put(self, *args, **kwargs)

    monkeypatch.setattr(Pending, "put", watched)
    return stacks


def test_a_model_call_reaches_the_journal_in_four_hops(tmp_path, monkeypatch):
    """An agent's call in completion order, through the real runner, its call sink, the run's durable log and the
    ledger over a real journal: Runner._answer -> DurableCalls -> DurableLog -> InFlight -> Pending (4 hops)."""
    import openai
    import torch
    from test_gateway import episodes, runner

    from verlj.engine.dist import Runtime
    from verlj.engine.loop.durable_log import DurableLog
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.rl.sources.agent_groups import DurableCalls, Settling
    from verlj.journal import Journal

    stacks = watch_puts(monkeypatch)

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        client.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.row["prompt"]}])
        return 1.0

    rt = Runtime(rank=0, world_size=1, local_rank=0, tp_size=1, device=torch.device("cpu"), backend="gloo")
    j = Journal.open_writer(tmp_path / "journal")
    log = DurableLog(rt, Ledger(j))
    r, gw, _ = runner(agent, {"row 0": "ab"})
    try:
        sink = DurableCalls(log, rt, 1, [(0, 3)], [100], 0, Settling())
        played = r.play(episodes(["row 0"], sink=sink))
    finally:
        gw.stop()
    assert played[0].fault == "" and len(log.read_in_flight()[0].agent_calls) == 1  # the call is durable, read back
    assert stacks and hops(stacks[0], "Runner._answer") == ["DurableCalls.keep_calls", "DurableLog.keep_in_flight", "InFlight.write_in_flight", "Pending.put"]
    j.close()


def test_a_stopped_generation_reaches_the_journal_in_three(tmp_path, monkeypatch):
    """rollout.partial: the generations a push stopped, through the real player part (sources.partial_groups.Partials):
    Partials.keep -> DurableLog -> InFlight -> Pending (the player's own write: 3 hops)."""
    from types import SimpleNamespace

    import torch

    from verlj.engine.dist import Runtime
    from verlj.engine.loop.durable_log import DurableLog
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.rl.sources.partial_groups import Partials
    from verlj.engine.rl.sources.players import GroupCall
    from verlj.journal import Journal

    stacks = watch_puts(monkeypatch)
    rt = Runtime(rank=0, world_size=1, local_rank=0, tp_size=1, device=torch.device("cpu"), backend="gloo")
    j = Journal.open_writer(tmp_path / "journal")
    log = DurableLog(rt, Ledger(j))
    stopped = [(4, [np.arange(2)] * 2, [np.zeros(2, np.float32)] * 2, [np.asarray([1, 2])] * 2, [False, True])]
    engine = SimpleNamespace(partials=lambda: stopped)
    got = Partials(rt, log).keep(GroupCall(2, 2, engine, {4: 3}, 6))
    assert got == {"rollout/partial/stopped_groups": 1.0, "rollout/partial/stopped_tokens": 4.0} and list(log.read_stopped()) == [4]
    assert hops(stacks[0], "Partials.keep") == ["DurableLog.keep_stopped", "InFlight.write_stopped", "Pending.put"]
    j.close()


def test_an_environment_s_turn_reaches_the_journal_in_three(tmp_path, monkeypatch):
    """rollout.env in completion order: a group's turn, through the real group player (sources.env_players.Turns) and
    its real envs (builtin:guess): the generator's turn arrives, the envs step, and the group as it stands is made
    durable before its next turn is asked: Turns.receive -> DurableLog -> InFlight -> Pending (3 hops)."""
    import torch
    from test_envs import CharTok

    from verlj.engine.config import make_config
    from verlj.engine.dist import Runtime
    from verlj.engine.loop.durable_log import DurableLog
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.rl.data import Example
    from verlj.engine.rl.envs import load_env
    from verlj.engine.rl.sources.env_players import Turns
    from verlj.engine.rl.sources.players import GroupCall
    from verlj.journal import Journal

    class Generator:  # the generator's side of completion order: each turn asked comes back as the action "50"
        def __init__(self):
            self.asked: list = []

        def ask(self, asks, cfg, most):
            self.asked += asks

        def arrived(self, wait):
            out = [(g, [np.asarray([53, 48])] * len(contexts), [np.zeros(2, np.float32)] * len(contexts), 0) for g, contexts, _ in self.asked]
            self.asked = []
            return out

    cfg = make_config(None, ["rollout.mode=async", "rollout.async_order=completion", "rollout.env=builtin:guess", "rollout.max_turns=3",
                             "rollout.n=2"])
    stacks = watch_puts(monkeypatch)
    rt = Runtime(rank=0, world_size=1, local_rank=0, tp_size=1, device=torch.device("cpu"), backend="gloo")
    j = Journal.open_writer(tmp_path / "journal")
    log = DurableLog(rt, Ledger(j))
    factory = load_env(cfg)
    turns = Turns(cfg, rt, CharTok(), [Example("guess", "")], [np.asarray([1, 2])], None, lambda: factory, log)
    generator = Generator()
    call = GroupCall(1, 0, generator, {5: 0}, 6)
    turns.ask([(5, 0)], call)
    made = turns.arrived(0.0, call)
    assert made.samples == [] and generator.asked and generator.asked[0][0] == 5  # the group goes on: its next turn asked
    held = log.read_in_flight()[5]
    # the turn is durable, read back: each episode's action, then the env's observation
    assert all(r.tolist()[:2] == [53, 48] and len(r) > 2 for r in held.response_ids) and held.versions == [0]
    assert len(stacks) == 1 and hops(stacks[0], "Turns.receive") == ["DurableLog.keep_in_flight", "InFlight.write_in_flight", "Pending.put"]
    j.close()
