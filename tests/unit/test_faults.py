"""rl.faults: which samples a fault leaves out of the update (GRPO groups left with fewer than two whole),
the step's counts and log note, the stop past rollout.max_fault_rate; a reward function's fault kept per
sample (rewards.scored_or_faults), journaled only where a batch has one (schema.sample) and kept in the rollout table
(schema.table: the archive, export)."""

from __future__ import annotations

import numpy as np
import pytest

from verlj.engine.errors import RunError
from verlj.engine.rl import faults
from verlj.engine.rl.data import Example
from verlj.engine.rl.rewards import scored_or_faults
from verlj.engine.schema import events as ev
from verlj.engine.schema.sample import EnvEnd, Sample, pack, unpack
from verlj_testing import raised_at


def smp(i: int, group: int, env: str | None = None, reward: str = "", episode: bool = False) -> Sample:
    ids = np.arange(3, dtype=np.int64)
    end = EnvEnd.FAULT if env else (EnvEnd.DONE if episode or env is not None else EnvEnd.NONE)
    return Sample(index=0, prompt_ids=ids, response_ids=ids, gen_logprobs=np.zeros(3, np.float32), id=i, group=group,
                  env_end=end, env_reason=env or "", fault=reward)


def test_faulted_samples_and_groups_left_with_one_are_excluded():
    batch = [smp(0, 0), smp(1, 0, env="step raised X"), smp(2, 0), smp(3, 0),  # one of four faulted: three kept
             smp(4, 4, reward="reward function f raised Y"), smp(5, 4, env="reset no answer in 1.0 s"), smp(6, 4), smp(7, 4),
             smp(8, 8, env="a"), smp(9, 8, env="b"), smp(10, 8, reward="c"), smp(11, 8)]  # one left: the group goes
    assert faults.excluded(batch, 2) == [1, 4, 5, 8, 9, 10, 11]
    assert faults.excluded(batch, 1) == [1, 4, 5, 8, 9, 10]  # PPO: no group statistics, a lone sample trains
    assert faults.excluded(batch[:4], 2) == [1] and faults.excluded([smp(0, 0), smp(1, 1)], 1) == []
    assert (faults.min_group("grpo", 8), faults.min_group("grpo", 1), faults.min_group("ppo", 8)) == (2, 1, 1)


def test_metrics_and_note_count_every_kind_and_name_the_first():
    batch = [smp(3, 0, reward="reward function f returned nan, not a finite number"), smp(1, 0, env="step raised RuntimeError: down"),
             smp(2, 0, episode=True), smp(0, 0, episode=True)]
    assert faults.metrics(batch) == {"rollout/faults": 2.0, "rollout/faults/env": 1.0, "rollout/faults/reward": 1.0,
                                     "rollout/fault_rate": 0.5}
    assert faults.note(batch) == "faults 2/4: step raised RuntimeError: down"  # the first by id
    assert faults.note(batch[2:]) == "faults 0/2" and faults.note([]) == ""
    assert faults.note([smp(0, 0), smp(1, 0)]) == ""  # single-turn samples, none faulted: nothing to say
    assert faults.note([smp(0, 0), smp(1, 0, reward="reward function f raised Y")]) == "faults 1/2: reward function f raised Y"
    assert faults.metrics([])["rollout/fault_rate"] == 0.0


def test_check_stops_past_the_rate_in_one_line():
    down = [smp(i, 0, env="step raised RuntimeError: the sandbox is down") for i in range(3)] + [smp(3, 0, episode=True)]
    faults.check(5, down[2:], 0.5, "runs/x")  # 1 of 2: at the rate, not past it
    faults.check(5, down, 1.0, "runs/x")
    with pytest.raises(RunError) as e:
        faults.check(5, down, 0.5, "runs/x")
    text = str(e.value)
    assert "\n" not in text and text.startswith("step 5: 3 of 4 episodes ended by a fault, more than rollout.max_fault_rate=0.5 allows: "
                                                "step raised RuntimeError: the sandbox is down. Nothing of step 5 was committed")
    assert "verlj train --output-dir runs/x --resume" in text and "verlj inspect runs/x --step 5" in text
    mixed = [smp(0, 0, reward="r1"), smp(1, 0, reward="r2"), smp(2, 0, reward="r2")]
    with pytest.raises(RunError, match="3 of 3 samples ended by a fault, .*: 2× r2; 1× r1. Nothing"):
        faults.check(1, mixed, 0.0, "r")


def test_reward_faults_are_per_sample():
    def f(prompt, response, answer):
        if response == "boom":
            raise ValueError("no answer key\nmore")
        return {"nan": float("nan"), "str": "1"}.get(response, 0.5)

    exs = [Example("1+1=", "2")] * 5
    rewards, bad = scored_or_faults(f, ["p"] * 5, ["ok", "boom", "nan", "str", "ok"], exs)
    assert rewards == [0.5, 0.0, 0.0, 0.0, 0.5]
    name = f"{f.__module__}.{f.__qualname__}"
    at = raised_at(__file__, 'raise ValueError("no answer key\\nmore")')  # where in the user's function
    assert bad == ["", f"reward function {name} raised ValueError: no answer key{at}", f"reward function {name} returned nan, not a finite number",
                   f"reward function {name} returned '1', not a finite number", ""]


def test_a_reward_fault_is_journaled_only_in_a_batch_that_has_one():
    plain, faulted = smp(0, 0), smp(1, 0, reward="reward function f raised X")
    assert "fault" not in pack([plain, plain])  # a batch without one: the bytes it always had
    back = unpack(pack([plain, faulted]))
    assert [s.fault for s in back] == ["", "reward function f raised X"] and back[1].same_as(faulted) and not back[0].same_as(faulted)
    assert [s.fault_reason for s in back] == ["", "reward function f raised X"]
    assert smp(2, 0, env="step raised X").fault_reason == "step raised X"
    assert ev.DropReason("fault") is ev.DropReason.FAULT


def test_the_rollout_table_keeps_each_samples_fault_through_parquet():
    """The archive keeps a sample whole: its reward function's fault is a text column of a table of steps that left samples
    out for a fault (schema.table.TEXT_COLUMNS), through Parquet and back; "" for a sample without one, null for a step
    whose samples carry none; a table without such steps has no such column (a single-turn table stays as it was)."""
    pa = pytest.importorskip("pyarrow")
    from verlj.engine.schema import table

    cols = table.step_columns(4, pack([smp(0, 0), smp(1, 0, reward="reward function f raised Y")]), None)
    clean = table.step_columns(5, pack([smp(2, 0), smp(3, 0)]), None)
    rows = list(table.rows(cols, texts=("fault",)))
    assert [r["fault"] for r in rows] == ["", "reward function f raised Y"]
    assert [r["fault"] for r in table.rows(clean, texts=("fault",))] == [None, None] and "fault" not in next(table.rows(cols))
    arrow = table.to_arrow(cols, texts=("fault",))
    assert arrow.schema.field("fault").type == pa.string() and list(table.rows(table.table_columns(arrow), texts=("fault",))) == rows
    assert "fault" not in table.to_arrow(cols).schema.names and table.to_arrow(clean, texts=("fault",)).column("fault").null_count == 2
