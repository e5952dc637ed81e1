"""The estimators and losses beside GRPO and PPO (RLOO, REINFORCE++, GSPO, loss_agg_mode, clip-higher) in
real runs: each differs from GRPO from its first step, a SIGKILL then --resume equals the uninterrupted run,
they train in async mode (in either order) and over episodes, and a what-if may switch to each (but not to or
from PPO)."""

from __future__ import annotations

import math

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.engine.post_mortem.counterfactual import whatif
from verlj.engine.schema.events import StepEvents
from verlj.journal import VerljError, open_journal_reader
from verlj_testing import TINY, assert_same_journal, fingerprints, train

COMMON = ["trainer.total_steps=4", "trainer.save_interval=2", "trainer.save_total_limit=0"]
VARIANTS = {
    "rloo": ["algorithm.name=rloo", "algorithm.loss_agg_mode=seq-mean-token-sum", "model.actor.clip_ratio_high=0.28"],
    "reinforce_plus_plus": ["algorithm.name=reinforce_plus_plus", "algorithm.kl_coef=0.05", "algorithm.loss_agg_mode=seq-mean-token-mean",
                            "model.actor.mini_batch_size=8", "distributed.zero_stage=1"],
    "gspo": ["model.actor.loss_mode=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean", "model.actor.clip_ratio_low=0.0003",
             "model.actor.clip_ratio_high=0.0004", "model.actor.ppo_epochs=2"],
    "rloo_no_kl": ["algorithm.name=rloo", "model.actor.use_kl_loss=false"],  # no reference model loaded (rl.workers)
    "dr_grpo": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.norm_adv_by_std=false"],
}


@pytest.fixture(scope="module")
def grpo(tmp_path_factory, reference_run):
    """GRPO's run (test_whatif's parent run, trained once)."""
    return reference_run(tmp_path_factory.mktemp("algos") / "grpo", [*TINY, *COMMON])


def metrics(run) -> dict[int, dict]:
    with open_journal_reader(run / "journal") as j:
        return {rec.step: StepEvents.of(rec).metrics.values for rec in j.iter_steps()}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_differs_from_grpo_and_a_kill_then_resume_is_exact(name, grpo, tmp_path):
    over = [*COMMON, *VARIANTS[name]]
    ref = tmp_path / "ref"
    run_train(ref, None, [*TINY, *over])
    mine, theirs = fingerprints(ref), fingerprints(grpo)
    assert sorted(mine) == [1, 2, 3, 4] and all(mine[s] != theirs[s] for s in mine)
    assert all(math.isfinite(m["actor/pg_loss"]) for m in metrics(ref).values())
    run = tmp_path / "run"
    out = train(run, *over, VERLJ_FAILPOINT="journal.before_commit:3")
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *over, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(run, ref)


@pytest.mark.parametrize("over", [
    ["rollout.mode=async", "algorithm.name=rloo", "model.actor.loss_mode=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"],
    ["rollout.mode=async", "rollout.async_order=completion", "algorithm.name=reinforce_plus_plus", "algorithm.kl_coef=0.05",
     "algorithm.loss_agg_mode=seq-mean-token-sum", "model.actor.clip_ratio_low=0.1", "model.actor.clip_ratio_high=0.28"],
    ["rollout.env=builtin:guess", "rollout.max_turns=3", "model.tiny.vocab=ascii", "algorithm.name=reinforce_plus_plus",
     "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "model.actor.clip_ratio_high=0.28"],
    ["rollout.env=builtin:guess", "rollout.max_turns=3", "model.tiny.vocab=ascii", "algorithm.name=rloo", "model.actor.loss_mode=gspo",
     "algorithm.loss_agg_mode=seq-mean-token-sum", "model.actor.clip_ratio_low=0.1", "model.actor.mini_batch_size=8"],
], ids=["async", "async-completion", "episodes", "episodes-rloo-gspo"])
def test_they_train_in_async_mode_and_over_episodes(over, tmp_path):
    out = train(tmp_path / "run", *COMMON, "trainer.total_steps=3", *over)
    assert out.returncode == 0, out.stderr[-3000:]
    got = metrics(tmp_path / "run")
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(m["actor/pg_loss"]) for m in got.values())


@pytest.mark.parametrize("keys", [
    ["algorithm.name=rloo", "model.actor.loss_mode=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean", "model.actor.clip_ratio_high=0.28"],
    ["algorithm.name=reinforce_plus_plus", "algorithm.kl_coef=0.05", "algorithm.loss_agg_mode=seq-mean-token-sum",
     "model.actor.clip_ratio_low=0.1"],
    ["algorithm.loss_agg_mode=dr_grpo", "algorithm.norm_adv_by_std=false"],  # TRL's name for seq-mean-token-sum-norm
], ids=["rloo-gspo", "reinforce_plus_plus", "dr_grpo"])
def test_a_whatif_may_change_the_estimator_and_the_loss_but_not_to_ppo(grpo, tmp_path, keys):
    assert whatif(grpo, 2, 4, tmp_path / "w", keys) == (3, 4)
    mine, theirs = fingerprints(tmp_path / "w"), fingerprints(grpo)
    assert sorted(mine) == [3, 4] and all(mine[s] != theirs[s] for s in (3, 4))
    with open_journal_reader(tmp_path / "w" / "journal") as j, open_journal_reader(grpo / "journal") as p:
        got, was = j.read_step(3).first("buffer.add")["samples"], p.read_step(3).first("buffer.add")["samples"]
        assert (got["response_ids"] == was["response_ids"]).all()  # re-trained on the run's own samples
    with pytest.raises(VerljError) as refused:
        whatif(grpo, 2, None, tmp_path / "p", ["algorithm.name=ppo"])
    assert str(refused.value).startswith("algorithm.name cannot change from grpo to ppo in a what-if") and "\n" not in str(refused.value)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_sequence_level_objective_is_the_same_on_two_ranks(mode, tmp_path):
    """The same samples (seeded per work item), each sample's loss divided by the mini-batch's samples on every
    rank: step 1's loss, entropy and gradient norm on two ranks are one rank's, up to the order of the sums."""
    over = [*COMMON, "trainer.total_steps=1", "algorithm.name=rloo", f"algorithm.loss_agg_mode={mode}", "model.actor.mini_batch_size=8",
            "model.actor.micro_batch_size=3"]  # 3 micro-batches on one rank, 2 a rank on two: the shares differ
    run_train(tmp_path / "one", None, [*TINY, *over])
    out = train(tmp_path / "two", *over, ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = metrics(tmp_path / "one")[1], metrics(tmp_path / "two")[1]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert math.isclose(one[key], two[key], rel_tol=1e-5, abs_tol=1e-9), (key, one[key], two[key])
