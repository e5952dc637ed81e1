"""GRPO / PPO math against values computed by hand."""

import math

import torch

from verlj.engine.rl import algorithms


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = algorithms.grpo_advantages(scores, groups, norm_by_std=True)
    # group 0: mean .5, unbiased std sqrt(.5) -> +-.5/.70711
    s = math.sqrt(0.5)
    expect = [0.5 / (s + algorithms.EPS), -0.5 / (s + algorithms.EPS), 0.0, 0.0, -1 / (math.sqrt(2) + algorithms.EPS), 1 / (math.sqrt(2) + algorithms.EPS)]
    assert torch.allclose(adv, torch.tensor(expect), atol=1e-6)
    no_std = algorithms.grpo_advantages(scores, groups, norm_by_std=False)
    assert torch.allclose(no_std, torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0]))


def test_policy_loss_clips_by_hand():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old log 0
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, clipfrac, approx_kl = algorithms.policy_loss(lp, old, adv, mask, clip_ratio=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(-0.5, -0.8) = -0.5; token 3: 2.0
    assert math.isclose(loss.item(), (-1.2 - 0.5 + 2.0) / 3, rel_tol=1e-6)
    assert math.isclose(clipfrac.item(), 1 / 3, rel_tol=1e-6)
    assert math.isclose(approx_kl.item(), -(math.log(1.5) + math.log(0.5)) / 3, rel_tol=1e-6)


def test_masked_tokens_do_not_count():
    lp = torch.tensor([[0.1, 5.0]])
    loss, _, _ = algorithms.policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.0]]), 0.2)
    assert math.isclose(loss.item(), -min(math.exp(0.1), 1.2), rel_tol=1e-6)


def test_kl_k3_by_hand():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([0.0, -0.5])
    # d = ref - lp = [0, .5]: exp(d) - d - 1
    assert torch.allclose(algorithms.kl_k3(lp, ref), torch.tensor([0.0, math.exp(0.5) - 1.5]))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    mask = torch.ones(1, 3)
    adv, ret = algorithms.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.75
    d1 = 0.0 + 0.9 * 0.75 - 0.25
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]), atol=1e-6)
    assert torch.allclose(ret, adv + values, atol=1e-6)


def test_gae_stops_at_the_end_of_each_response():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 9.0]])  # the padded position must not leak in
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, _ = algorithms.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.0]]))


def test_token_rewards_place_score_on_last_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.full((2, 3), 0.5)
    r = algorithms.token_rewards(torch.tensor([2.0, -1.0]), mask, kl, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([[-0.05, 1.95, 0.0], [-0.05, -0.05, -1.05]]))


def test_grpo_token_advantages_put_each_rows_advantage_on_its_tokens():
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 2, 2])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = algorithms.grpo_token_advantages(scores, groups, [1, 0], mask, norm_by_std=False)  # this rank's rows: 1, then 0
    assert torch.equal(adv, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))


def test_ppo_advantages_are_gae_of_the_kl_penalised_rewards_whitened():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    scores, values = torch.tensor([2.0, -1.0]), torch.tensor([[0.5, 0.25, 0.0], [0.1, -0.2, 0.3]])
    lp, ref = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]]), torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -2.0, -0.25]])
    adv, ret = algorithms.ppo_advantages(scores, values, mask, lp, ref, 0.1, 0.9, 0.8)
    rewards = algorithms.token_rewards(scores, mask, algorithms.kl_k3(lp, ref), 0.1)
    want_adv, want_ret = algorithms.gae(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, algorithms.whiten(want_adv, mask)) and torch.equal(ret, want_ret)
    assert math.isclose(algorithms.masked_mean(adv, mask).item(), 0.0, abs_tol=1e-6)
    no_kl, _ = algorithms.ppo_advantages(scores, values, mask, lp, None, 0.1, 0.9, 0.8)
    assert torch.equal(no_kl, algorithms.whiten(algorithms.gae(algorithms.token_rewards(scores, mask, None, 0.1), values, mask, 0.9, 0.8)[0], mask))
    assert not torch.equal(no_kl, adv)


def test_value_loss_clipping_by_hand():
    v, old, ret = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]])
    loss, clipfrac = algorithms.value_loss(v, old, ret, torch.ones(1, 1), cliprange=0.5)
    # clipped value .5: (.5-2)^2 = 2.25 > (1-2)^2 = 1 -> 0.5 * 2.25
    assert math.isclose(loss.item(), 1.125) and clipfrac.item() == 1.0


def test_entropy_of_uniform():
    assert math.isclose(algorithms.entropy_from_logits(torch.zeros(1, 4)).item(), math.log(4), rel_tol=1e-6)


def test_an_episodes_observation_tokens_are_skipped_by_gae_and_token_rewards():
    """An episode's mask has holes (observation tokens): the score lands on the last policy token, and GAE
    over [a a o o a] equals GAE over the same row with the observation tokens cut out."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    rewards = algorithms.token_rewards(torch.tensor([2.0]), mask, None, 0.0)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]
    values = torch.tensor([[0.5, -1.0, 7.0, 7.0, 0.25, 0.0]]) * mask
    adv, ret = algorithms.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = [0, 1, 4]
    cut_r, cut_v, cut_m = rewards[:, keep], values[:, keep], torch.ones(1, 3)
    want_adv, want_ret = algorithms.gae(cut_r, cut_v, cut_m, gamma=0.9, lam=0.8)
    assert torch.equal(adv[:, keep], want_adv) and torch.equal(ret[:, keep], want_ret)
    assert adv[0, 2:4].tolist() == [0.0, 0.0] and ret[0, 2:4].tolist() == [0.0, 0.0]


def test_rloo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = algorithms.rloo_advantages(scores, groups)
    # group 0: each score minus the mean of the other two; group 1 (one sample) keeps its score
    assert torch.allclose(adv, torch.tensor([1 - 1.0, 0 - 1.5, 2 - 0.5, 5.0, 3 - 4.0, 4 - 3.0]))
    # a sample left out counts in no group's statistics and gets 0
    left = algorithms.rloo_advantages(scores, groups, valid=torch.tensor([True, True, False, True, True, True]))
    assert torch.allclose(left, torch.tensor([1.0, -1.0, 0.0, 5.0, -1.0, 1.0]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert torch.allclose(algorithms.rloo_token_advantages(scores, groups, [4, 0], mask), torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))


def test_discounted_returns_by_hand_and_over_an_episodes_holes():
    rewards = torch.tensor([[0.0, 0.0, 2.0], [1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.allclose(algorithms.discounted_returns(rewards, mask, 0.5), torch.tensor([[0.5, 1.0, 2.0], [2.5, 3.0, 0.0]]))
    # an observation token (mask 0 inside the response) is skipped: its neighbours discount as if adjacent
    holed = algorithms.discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[1.0, 0.0, 1.0]]), 0.5)
    assert torch.allclose(holed, torch.tensor([[2.0, 0.0, 2.0]]))


def test_reinforce_pp_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = algorithms.reinforce_pp_advantages(scores, mask, None, None, 0.0, 1.0)
    # returns (gamma 1): [[1, 1], [0, -]]; token mean 2/3, biased variance 2/9: whitened over the 3 tokens
    m, sd = 2 / 3, math.sqrt(2 / 9 + 1e-8)
    want = torch.tensor([[(1 - m) / sd, (1 - m) / sd], [(0 - m) / sd, 0.0]])
    assert torch.allclose(adv, want, atol=1e-6)
    # the KL to the reference enters the rewards (as PPO's) when kl_coef > 0
    lp, ref = torch.zeros(2, 2), torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    with_kl = algorithms.reinforce_pp_advantages(scores, mask, lp, ref, 0.1, 1.0)
    rewards = algorithms.token_rewards(scores, mask, algorithms.kl_k3(lp, ref), 0.1)
    assert torch.equal(with_kl, algorithms.whiten(algorithms.discounted_returns(rewards, mask, 1.0), mask))
    assert not torch.allclose(with_kl, adv)


def test_loss_aggregation_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    agg = algorithms.agg_loss
    assert math.isclose(agg(x, mask).item(), 10 / 4)
    assert torch.equal(agg(x, mask, "token-mean", 8.0), algorithms.masked_mean(x, mask, 8.0))
    assert math.isclose(agg(x, mask, "seq-mean-token-sum").item(), (6 + 4) / 2)
    assert math.isclose(agg(x, mask, "seq-mean-token-mean").item(), (2 + 4) / 2)
    assert math.isclose(agg(x, mask, "seq-mean-token-sum-norm", norm_len=5.0).item(), 10 / (2 * 5))
    # a micro-batch that is one share of a larger mini-batch divides by the mini-batch's sample count
    assert math.isclose(agg(x, mask, "seq-mean-token-mean", seqs=4).item(), (2 + 4) / 4)
    halves = agg(x[:1], mask[:1], "seq-mean-token-sum", seqs=2) + agg(x[1:], mask[1:], "seq-mean-token-sum", seqs=2)
    assert torch.allclose(halves, agg(x, mask, "seq-mean-token-sum"))


def test_clip_higher_by_hand():
    lp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    # ratio 1.5 with A>0 clips at 1 + high; 0.5 with A<0 clips at 1 - low
    loss, clipfrac, _ = algorithms.policy_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.1, clip_ratio_high=0.28)
    assert math.isclose(loss.item(), (-1.28 + 0.9) / 2, rel_tol=1e-6) and math.isclose(clipfrac.item(), 1.0)
    same = algorithms.policy_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2, clip_ratio_high=0.2)
    assert torch.equal(same[0], algorithms.policy_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2)[0])


def test_gspo_sequence_ratio_by_hand():
    # sample 0: log-ratios 0.2 and 0.0 -> sequence ratio exp(0.1) on both tokens; sample 1: one token, log-ratio -1
    lp = torch.tensor([[0.2, 0.0], [-1.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    loss, clipfrac, _ = algorithms.policy_loss(lp, torch.zeros(2, 2), adv, mask, 0.2, loss_mode="gspo")
    r0 = math.exp(0.1)
    # token-mean of -A*s: sample 0 unclipped (-r0 each), sample 1 clipped at 0.8: max(e^-1, 0.8) = 0.8
    assert math.isclose(loss.item(), (-r0 - r0 + 0.8) / 3, rel_tol=1e-6)
    assert math.isclose(clipfrac.item(), 1 / 3, rel_tol=1e-6)
    loss.backward()
    # GSPO-token: each token's gradient is its sequence ratio times its own log-prob's (-A * s / 3 here)
    assert torch.allclose(lp.grad, torch.tensor([[-r0 / 3, -r0 / 3], [0.0, 0.0]]), atol=1e-6)
    tok, _, _ = algorithms.policy_loss(lp.detach(), torch.zeros(2, 2), adv, mask, 0.2)
    assert not math.isclose(tok.item(), loss.item())
