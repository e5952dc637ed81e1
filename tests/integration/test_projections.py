"""metrics.jsonl, TensorBoard and W&B are projections of the journal: after kills at random moments,
the resumed run has delivered every committed step to each of them once, in order."""

from __future__ import annotations

import json
import random
from collections import Counter

from test_recovery import kill_at_random, resume_until_done

from verlj.engine.report import wandb_steps
from verlj_testing import assert_same_journal, train

TARGET = 8
SINKS = [f"trainer.total_steps={TARGET}", "trainer.save_interval=3", "logging.wandb=true", "logging.tensorboard=true"]


def tensorboard_steps(run) -> Counter:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter = Counter()
    for path in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if any(v.tag == "critic/score/mean" for v in event.summary.value):
                seen[event.step] += 1
    return seen


def test_every_sink_holds_every_committed_step_once_after_kills(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    ref = tmp_path / "ref"
    assert train(ref, *SINKS).returncode == 0
    run = tmp_path / "run"
    rng = random.Random(3)
    for _ in range(2):
        kill_at_random(run, [*SINKS], rng)  # the whole process group: W&B's service dies with the trainer
    resume_until_done(run, SINKS)
    assert_same_journal(ref, run)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, TARGET + 1))
    journaled = {x["step"]: x for x in (json.loads(y) for y in (ref / "metrics.jsonl").read_text().splitlines())}
    for x in lines:  # re-sent lines carry the journaled values
        assert x["critic/score/mean"] == journaled[x["step"]]["critic/score/mean"]
    assert wandb_steps(run) == list(range(1, TARGET + 1))  # decoded from W&B's offline run files: each step once
    assert tensorboard_steps(run) == Counter(range(1, TARGET + 1))
