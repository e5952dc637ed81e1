"""The pieces that make a run's data flow and objective the same at any world size, and the rules
for resharding: mini-batch sharding, global-token loss normalisation, the stored config's legacy
values, the topology policy, TP shard layouts."""

import numpy as np
import pytest
import torch

from verlj.engine.config import Config, check_change, config_from_dict, stored_config
from verlj.engine.errors import ConfigError, SnapshotError
from verlj.engine.rl import algorithms
from verlj.engine.rl.workers import shard_batch
from verlj.engine.schema.sample import Sample
from verlj.engine.state.reshard import _split_dim
from verlj.engine.state.topology import Topology, refusal


def samples(lengths):
    return [Sample(index=0, prompt_ids=np.zeros(1, np.int64), response_ids=np.zeros(n, np.int64), gen_logprobs=np.zeros(n, np.float32))
            for n in lengths]


@pytest.mark.parametrize("mini", [0, 4, 6])
def test_global_mini_batches_are_the_same_at_any_world_size(mini):
    s = samples([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
    one_rows, one_minis = shard_batch(s, mini, 1, 0, global_tokens=True)
    for D in (2,):
        per_rank = [shard_batch(s, mini, D, r, global_tokens=True) for r in range(D)]
        assert all(len(m) == len(one_minis) for _, m in per_rank)
        for k, whole in enumerate(one_minis):
            union = sorted(i for rows, m in per_rank for i in rows[m[k].start : m[k].stop])
            assert union == one_rows[whole.start : whole.stop]  # the same samples form mini-batch k
            assert all(m[k].tokens == whole.tokens for _, m in per_rank)  # divided by the same token count
            assert all(m[k].seqs == whole.seqs == whole.stop - whole.start for _, m in per_rank)  # and sample count
            assert whole.tokens == sum(len(s[i].response_ids) for i in one_rows[whole.start : whole.stop])


def test_micro_batch_normalisation_keeps_the_old_contiguous_shares():
    s = samples([2] * 8)
    rows, minis = shard_batch(s, 4, 2, 1, global_tokens=False)
    assert rows == [4, 5, 6, 7] and [(m.start, m.stop, m.tokens) for m in minis] == [(0, 2, None), (2, 4, None)]


def test_global_token_loss_has_the_same_gradient_however_it_is_split():
    torch.manual_seed(0)
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.3).double()
    algorithms.masked_mean(x, mask).backward()
    whole = x.grad.clone()
    # 2 ranks x 2 micro-batches each: DeepSpeed averages over both (1 / (dp * accumulation))
    x.grad = None
    T, D, GAS = mask.sum(), 2, 2
    for rows in ((0, 2), (2, 4), (4, 6), (6, 8)):
        part = algorithms.masked_mean(x[rows[0] : rows[1]], mask[rows[0] : rows[1]], T) * (D * GAS)
        (part / (D * GAS)).backward()
    assert torch.allclose(x.grad, whole, rtol=0, atol=1e-15)
    # the old per-micro-batch token mean is another objective when the micro-batches' token counts differ
    x.grad = None
    for rows in ((0, 2), (2, 4), (4, 6), (6, 8)):
        (algorithms.masked_mean(x[rows[0] : rows[1]], mask[rows[0] : rows[1]]) / 4).backward()
    assert not torch.allclose(x.grad, whole)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sequence_level_losses_have_the_same_gradient_however_they_are_split(mode):
    torch.manual_seed(0)
    x = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.3).double()
    algorithms.agg_loss(x, mask, mode, norm_len=5.0).backward()
    whole = x.grad.clone()
    x.grad = None
    for rows in ((0, 2), (2, 4), (4, 6), (6, 8)):  # 2 ranks x 2 micro-batches, each dividing by the 8 samples
        algorithms.agg_loss(x[rows[0] : rows[1]], mask[rows[0] : rows[1]], mode, 1.0, 8, 5.0).backward()
    assert torch.allclose(x.grad, whole, rtol=0, atol=1e-15)


def test_global_masked_mean_adds_every_ranks_tokens():
    torch.manual_seed(1)
    x, mask = torch.randn(6, 4), (torch.rand(6, 4) > 0.2).float()
    other = torch.stack([(x[3:] * mask[3:]).sum(), mask[3:].sum()])  # what the other rank contributes
    mean = algorithms.global_masked_mean(x[:3], mask[:3], lambda t: t + other)
    assert torch.allclose(mean, algorithms.masked_mean(x, mask))
    # one rank: the same bits as the plain token mean, and whitening is unchanged
    assert torch.equal(algorithms.global_masked_mean(x, mask, lambda t: t), algorithms.masked_mean(x, mask))
    assert torch.equal(algorithms.whiten(x, mask, lambda t: t), algorithms.whiten(x, mask))


def test_stored_configs_without_the_key_keep_the_old_objective():
    old = Config().to_dict()
    del old["algorithm"]["loss_normalization"]
    assert config_from_dict(stored_config(old)).algorithm.loss_normalization == "micro_batch"
    assert config_from_dict(stored_config(Config().to_dict())).algorithm.loss_normalization == "global_tokens"
    # a resume of such a run (its stored config, no override) changes nothing
    cfg = config_from_dict(stored_config(old))
    assert check_change(stored_config(old), cfg, allow_live=False, how="resume") == []


def test_topology_keys_may_change_on_resume_fixed_ones_not():
    stored = Config().to_dict()
    new = config_from_dict({**stored, "distributed": {**stored["distributed"], "zero_stage": 3, "tensor_parallel_size": 2}})
    assert check_change(stored, new, allow_live=False, how="resume") == ["distributed.tensor_parallel_size", "distributed.zero_stage"]
    new = config_from_dict({**stored, "algorithm": {**stored["algorithm"], "loss_normalization": "micro_batch"}})
    with pytest.raises(ConfigError, match="algorithm.loss_normalization cannot change within a run"):
        check_change(stored, new, allow_live=False, how="resume")


def test_what_can_be_resharded():
    z2x2, z0tp2, z1tp2 = Topology(2, 1, 2), Topology(2, 2, 0), Topology(2, 2, 1)
    assert refusal(z2x2, Topology(1, 1, 3)) is None
    assert refusal(z0tp2, Topology(1, 1, 0)) is None and refusal(Topology(1, 1, 2), z0tp2) is None
    assert "cannot be resharded" in refusal(z1tp2, Topology(1, 1, 1))
    assert "only at ZeRO-0" in refusal(z2x2, z1tp2)
    assert str(Topology(1, 1, 3)) == "1 rank, ZeRO-3, TP 1"
    # a run with the old per-micro-batch objective stays on its topology
    assert "resume it on 2 ranks, ZeRO-2, TP 1" in refusal(z2x2, Topology(1, 1, 2), "micro_batch")
    assert refusal(z2x2, z2x2, "micro_batch") is None


def test_tp_shards_uneven_and_replicated():
    assert _split_dim([(10, 64), (9, 64)], (19, 64)) == 0
    assert _split_dim([(64, 32), (64, 32)], (64, 64)) == 1
    assert _split_dim([(64,), (64,)], (64,)) is None
    with pytest.raises(SnapshotError, match="do not make up the full shape"):
        _split_dim([(10, 64), (10, 64)], (19, 64))
