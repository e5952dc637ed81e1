"""rollout.agent=verifiers:TASKSET and data.train_dataset=verifiers:TASKSET (engine/rl/gateway/verifiers_agent.py): the
two keys name one taskset; a missing verifiers package, a module that exports no taskset or two, an infinite taskset
and two tasks with one key are each one sentence; a taskset's tasks become the rows in load() order, each answer its
task's key. The episodes themselves: tests/integration/test_verifiers_taskset.py."""

from __future__ import annotations

import sys
import types

import pytest

from verlj.engine.config import ConfigError, make_config
from verlj.engine.rl.gateway.agents import load_agent
from verlj.engine.rl.gateway.verifiers_agent import taskset_rows
from verlj_testing import REPO

TASKSET = "verifiers:examples.verifiers_taskset"


@pytest.mark.parametrize("over", [[f"data.train_dataset={TASKSET}"], [f"rollout.agent={TASKSET}"],
                                  [f"data.train_dataset={TASKSET}", "rollout.agent=verifiers:other"]])
def test_the_two_keys_name_one_taskset(over):
    with pytest.raises(ConfigError, match="data.train_dataset and rollout.agent name one verifiers taskset together"):
        make_config(None, over)


def test_both_keys_on_one_taskset_validate_without_the_package():
    cfg = make_config(None, [f"data.train_dataset={TASKSET}", f"rollout.agent={TASKSET}"])  # rollout.reward_fn auto: unused
    assert cfg.rollout.agent == cfg.data.train_dataset == TASKSET


def test_a_missing_verifiers_package_is_one_sentence_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError) as e:
        taskset_rows("examples.verifiers_taskset")
    assert str(e.value) == ("data.train_dataset=verifiers:... needs the verifiers package, in a venv of its own (it pins openai<3, "
                            "which the agent and dev extras' openai-agents refuses): pip install 'verlj[verifiers]' "
                            "(in a checkout: pip install -e '.[verifiers]')")
    with pytest.raises(ConfigError, match=r"rollout.agent=verifiers:\.\.\. needs the verifiers package, in a venv of its own"):
        load_agent(TASKSET)


@pytest.fixture
def vf(monkeypatch):
    import verifiers.v1 as vf
    monkeypatch.syspath_prepend(str(REPO))
    return vf


def test_the_tasks_are_the_rows_in_load_order_each_answer_its_key(vf):
    from examples.verifiers_taskset import ArithmeticTaskset

    tasks = list(ArithmeticTaskset(vf.TasksetConfig()))
    rows = taskset_rows("examples.verifiers_taskset")
    assert rows == [(t.data.prompt_text, t.key) for t in tasks] and len(rows) == 64
    assert taskset_rows("examples.verifiers_taskset:ArithmeticTaskset") == rows
    assert rows[0][0].startswith("What is ") and len({k for _, k in rows}) == 64


def _module(monkeypatch, vf, name: str, **attrs) -> str:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__all__ = list(attrs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, m)
    return name


def _taskset(vf, prompts: list[str], infinite: bool = False) -> type:
    class Tasks(vf.Taskset):
        INFINITE = infinite

        def load(self):
            return [vf.Task(vf.TaskData(prompt=p)) for p in prompts]

    return Tasks


def test_a_module_must_export_one_taskset(vf, monkeypatch):
    none = _module(monkeypatch, vf, "vf_none", x=1)
    with pytest.raises(ConfigError, match="module 'vf_none' must export exactly one vf.Taskset subclass in __all__ .found 0."):
        taskset_rows(none)
    two = _module(monkeypatch, vf, "vf_two", A=_taskset(vf, ["a"]), B=_taskset(vf, ["b"]))
    with pytest.raises(ConfigError, match="found 2.; or name it: verifiers:vf_two:CLASS"):
        taskset_rows(two)
    assert taskset_rows(f"{two}:B") == [("b", vf.Task(vf.TaskData(prompt="b", idx=0)).key)]
    not_one = _module(monkeypatch, vf, "vf_not", x=1)
    with pytest.raises(ConfigError, match="verifiers:vf_not:x is not a verifiers Taskset class"):
        taskset_rows(f"{not_one}:x")


def test_an_infinite_taskset_and_two_tasks_with_one_key_are_refused(vf, monkeypatch):
    with pytest.raises(ConfigError, match="the verifiers taskset Tasks is infinite"):
        taskset_rows(_module(monkeypatch, vf, "vf_inf", T=_taskset(vf, ["a"], infinite=True)))
    class Keyed(vf.Task):
        @property
        def key(self) -> str:  # a durable id of its own, as a dataset's instance id would be: here the same twice
            return "k"

    class Same(vf.Taskset):
        def load(self):
            return [Keyed(vf.TaskData(prompt="a")), Keyed(vf.TaskData(prompt="b"))]

    with pytest.raises(ConfigError, match="two tasks of Same have the key 'k'"):
        taskset_rows(_module(monkeypatch, vf, "vf_same", T=Same))
