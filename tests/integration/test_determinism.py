"""Two runs of the same config journal the same steps: indices, seeds, samples, metrics, fingerprints."""

import pytest

from verlj.engine.loop.run import train as run_train
from verlj_testing import TINY, assert_same_journal, comparable_steps, fingerprints


def inprocess(run_dir, *overrides):
    return run_train(run_dir, None, [*TINY, "trainer.total_steps=3", "trainer.save_interval=0", *overrides])


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_same_config_same_journal(tmp_path, algo, zero):
    over = [f"algorithm.name={algo}", f"distributed.zero_stage={zero}"]
    for run in ("a", "b"):
        done = inprocess(tmp_path / run, *over)
        assert (done.last, done.snapshots_failed) == (3, None)
    assert_same_journal(tmp_path / "a", tmp_path / "b")
    steps = comparable_steps(tmp_path / "a")
    fps = [next(e for e in s["events"] if e["type"] == "state")["fingerprint"] for s in steps]
    assert len(set(fps)) == 3  # the state changes every step: the check is not vacuous
    adds = next(e for e in steps[0]["events"] if e["type"] == "buffer.add")
    assert adds["samples"]["response_ids"].shape[0] == 16  # 4 prompts x 4 samples


def test_a_different_seed_gives_a_different_journal(tmp_path):
    inprocess(tmp_path / "a")
    inprocess(tmp_path / "b", "trainer.seed=2")
    assert fingerprints(tmp_path / "a") != fingerprints(tmp_path / "b")


def test_dynamic_sampling_carries_samples_to_the_next_step(tmp_path):
    over = ["algorithm.dynamic_sampling=true", "rollout.n=2", "trainer.total_steps=4"]
    inprocess(tmp_path / "a", *over)
    inprocess(tmp_path / "b", *over)
    assert_same_journal(tmp_path / "a", tmp_path / "b")
    steps = comparable_steps(tmp_path / "a")
    carried = False
    pending: set[int] = set()
    for s in steps:
        ev = {e["type"]: e for e in s["events"]}
        added = set(ev["buffer.add"]["ids"].tolist())
        consumed = ev["buffer.consume"]["ids"].tolist()
        dropped = set(ev["buffer.drop"]["ids"].tolist())
        assert dropped <= added
        if pending & set(consumed):
            carried = True  # a sample generated at an earlier step was trained on now
        pending = (pending | added) - dropped - set(consumed)
        assert ev["metrics"]["values"]["buffer/pending"] == len(pending)
    assert carried
