"""`verlj diff --stages` on seeded divergences: each names the stage where the runs part first, and
the first element there, read from the journal (data drawn, scores) or from both runs' step
re-executed (loss, parameters after), each compared with an uninterrupted base run."""

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem.diff import first_difference, render_diff
from verlj.engine.post_mortem.rerun import diff_stages
from verlj_testing import TINY, verlj

REWARD = '''
from verlj.engine.rl.rewards import add_reward

calls = []

def add_but_one(prompt, response, answer):
    """builtin:add, except that the 6th sample scored gets 0.5 more."""
    calls.append(prompt)
    return add_reward(prompt, response, answer) + (0.5 if len(calls) == 6 else 0.0)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    (root / "changed_reward.py").write_text(REWARD)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    variants = {"base": ["trainer.total_steps=2"], "lr": ["trainer.total_steps=1", "model.actor.optim.lr=0.002"],
                "kl": ["trainer.total_steps=2", "model.actor.kl_loss_coef=0.02"], "seed": ["trainer.total_steps=1", "trainer.seed=2"],
                "reward": ["trainer.total_steps=1", "rollout.reward_fn=changed_reward:add_but_one"]}
    try:
        for name, over in variants.items():
            run_train(root / name, None, [*TINY, "trainer.save_interval=0", *over])
    finally:
        mp.undo()
    return root


def test_a_changed_learning_rate_first_differs_in_the_parameters_after(runs):
    d = diff_stages(runs / "base", runs / "lr")
    st = d.detail.stages
    assert d.step == 1 and st.stage == "state" and st.reexecuted
    e = st.element
    assert e.part.startswith("actor/param/") and e.a != e.b and 0 < e.largest_abs_diff < 0.01
    assert "both runs' step 1 re-executed" in render_diff(d, runs / "base", runs / "lr")


def test_a_changed_kl_coefficient_first_differs_in_the_loss(runs):
    """The policy equals the reference at step 1 (no KL), so the runs part at step 2's loss."""
    d = diff_stages(runs / "base", runs / "kl")
    st = d.detail.stages
    assert d.step == 2 and st.stage == "loss"
    assert st.element.part == "loss[0]" and st.element.a != st.element.b


def test_a_reward_changed_for_one_sample_is_named_with_that_sample(runs):
    out = verlj("diff", runs / "base", runs / "reward", "--stages")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "first differing stage: scores" in out.stdout and "consumed sample #5 (ids 5 / 5) score[0]" in out.stdout
    d = diff_stages(runs / "base", runs / "reward")
    e = d.detail.stages.element
    assert (e.field, e.sample_a, e.b - e.a) == ("score", 5, 0.5)  # the 6th sample scored


def test_a_different_seed_first_differs_in_the_data_drawn(runs):
    d = first_difference(runs / "base", runs / "seed")
    st = d.detail.stages
    assert d.step == 1 and st.stage == "data" and st.element.field == "index"
    assert st.element.a != st.element.b
