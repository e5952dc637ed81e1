import json
import sys

import numpy as np
import pytest
import torch

from verlj.engine.config import DataConfig
from verlj.engine.errors import SnapshotError
from verlj.engine.rl.buffer import RolloutBuffer
from verlj.engine.rl.data import DataError, Sampler, load_dataset
from verlj.engine.rl.rewards import RewardError, add_reward, load_reward_fn, rule_rewards
from verlj.engine.rl.sampler import sample_token
from verlj.engine.rl.samples import pack, unpack
from verlj.journal import packb, unpackb


def test_sampler_is_a_per_epoch_permutation_with_a_cursor():
    s = Sampler(10, seed=3)
    first = s.draw(7)
    rest = s.draw(7)  # crosses into epoch 1
    assert sorted(np.concatenate([first, rest[:3]]).tolist()) == list(range(10))
    assert (s.epoch, s.cursor) == (1, 4)
    again = Sampler(10, seed=3)
    again.load_state_dict(s.state_dict())
    assert np.array_equal(again.draw(5), s.draw(5))
    with pytest.raises(DataError, match="resume with the same dataset"):
        Sampler(11, seed=3).load_state_dict(s.state_dict())


def test_builtin_dataset_is_deterministic():
    cfg = DataConfig()
    a, b = load_dataset(cfg, 1), load_dataset(cfg, 1)
    assert a == b and len(a) == cfg.num_examples
    p, ans = a[0].prompt, a[0].answer
    x, y = p.rstrip("=").split("+")
    assert int(x) + int(y) == int(ans)


def test_jsonl_and_parquet_and_missing_fields(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    cfg = DataConfig(train_dataset=str(f), prompt_key="q", answer_key="a")
    assert load_dataset(cfg, 0)[0].answer == "2"
    with pytest.raises(DataError, match="lacks the fields 'prompt' and 'answer'"):
        load_dataset(DataConfig(train_dataset=str(f)), 0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2+2="], "answer": ["4"]}), tmp_path / "d.parquet")
    assert load_dataset(DataConfig(train_dataset=str(tmp_path / "d.parquet")), 0)[0].prompt == "2+2="
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(DataConfig(train_dataset=str(tmp_path / "none.jsonl")), 0)


def sample(i, plen, rlen):
    rng = np.random.default_rng(i)
    return {
        "id": i, "index": i * 3, "group": i - i % 2, "score": float(rng.standard_normal()), "rule_reward": 0.5, "rm_score": 0.0,
        "policy_version": i // 2,
        "prompt_ids": rng.integers(0, 50, plen), "response_ids": rng.integers(0, 50, rlen),
        "gen_logprobs": rng.standard_normal(rlen).astype(np.float32),
        "ref_logprobs": rng.standard_normal(rlen).astype(np.float32),
    }


def test_pack_unpack_through_the_codec_is_exact():
    samples = [sample(i, 3 + i, 1 + 2 * i) for i in range(4)]
    back = unpack(unpackb(packb(pack(samples))))
    for a, b in zip(samples, back):
        for k in a:
            assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
        assert b["gen_logprobs"].dtype == np.float32 and b["response_ids"].dtype == np.int64


def test_buffer_ops_and_state():
    buf = RolloutBuffer()
    buf.add([sample(i, 2, 2) for i in range(6)])
    buf.drop([2, 3])
    taken = buf.consume([0, 1])
    assert [s["id"] for s in taken] == [0, 1] and list(buf.samples) == [4, 5] and buf.next_id == 6
    assert buf.groups() == {4: [4, 5]}
    other = RolloutBuffer()
    other.load_state_dict(unpackb(packb(buf.state_dict())))
    assert list(other.samples) == [4, 5] and other.next_id == 6


def test_buffer_plans_hide_planned_samples_and_survive_a_snapshot():
    buf = RolloutBuffer()
    buf.add([sample(i, 2, 2) for i in range(8)])
    buf.plan({3: np.array([2, 3]), 2: np.array([0, 1])})
    assert buf.groups() == {4: [4, 5], 6: [6, 7]} and buf.planned_through() == 3
    with pytest.raises(AssertionError, match="planned twice"):
        buf.plan({3: np.array([4, 5])})
    other = RolloutBuffer()
    other.load_state_dict(unpackb(packb(buf.state_dict())))
    assert sorted(other.plans) == [2, 3] and other.plans[3].tolist() == [2, 3] and other.groups() == buf.groups()
    assert [s["policy_version"] for s in other.samples.values()] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a version-1 state (before plans and policy versions): no plans, versions unknown
    old = buf.state_dict()
    old["version"] = 1
    del old["plan_steps"], old["plans"]
    old["samples"] = {k: v for k, v in old["samples"].items() if k != "policy_version"}
    v1 = RolloutBuffer()
    v1.load_state_dict(unpackb(packb(old)))
    assert v1.plans == {} and {s["policy_version"] for s in v1.samples.values()} == {-1} and len(v1) == 8
    old["version"] = 3
    with pytest.raises(SnapshotError, match="version 3"):
        RolloutBuffer().load_state_dict(old)


def test_rule_reward_and_loading():
    assert add_reward("3+4=", "7", "7") == 1.0
    assert add_reward("3+4=", "8", "7") == pytest.approx(0.3)
    assert add_reward("3+4=", "x7", "7") == 0.0
    assert load_reward_fn("builtin:add") is add_reward
    with pytest.raises(RewardError, match="cannot import 'no_such_module_xyz:f'"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="unknown built-in"):
        load_reward_fn("builtin:nope")


def test_user_reward_functions_fail_in_one_sentence(tmp_path, monkeypatch):
    """module:function from the working directory (as `python -m` allows); numpy scalars are numbers;
    a raising, misshapen or unimportable function is one RewardError naming it."""
    (tmp_path / "my_rewards_ok.py").write_text(
        "import numpy as np\n"
        "def np_score(prompt, response, answer):\n    return np.float32(0.5)\n"
        "def boom(prompt, response, answer):\n    raise ValueError('no answer key')\n"
        "def two(prompt, response):\n    return 1.0\n"
        "def text(prompt, response, answer):\n    return 'high'\n"
    )
    (tmp_path / "my_rewards_broken.py").write_text("raise RuntimeError('cannot start')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = load_reward_fn("my_rewards_ok:np_score")
    assert rule_rewards(fn, ["1+1="], ["2"], ["2"]) == [0.5]
    with pytest.raises(RewardError, match=r"reward function my_rewards_ok.boom raised ValueError: no answer key \(prompt '1\+1='\)"):
        rule_rewards(load_reward_fn("my_rewards_ok:boom"), ["1+1="], ["2"], ["2"])
    with pytest.raises(RewardError, match="my_rewards_ok:two .* has the wrong signature"):
        load_reward_fn("my_rewards_ok:two")
    with pytest.raises(RewardError, match="returned 'high'.*must return a finite number"):
        rule_rewards(load_reward_fn("my_rewards_ok:text"), ["1+1="], ["2"], ["2"])
    with pytest.raises(RewardError, match="importing module 'my_rewards_broken' failed: RuntimeError: cannot start"):
        load_reward_fn("my_rewards_broken:f")
    with pytest.raises(RewardError, match="module 'my_rewards_ok' has no 'nope'"):
        load_reward_fn("my_rewards_ok:nope")


def test_sampling_uses_only_its_uniforms():
    logits = torch.randn(6, 11)
    u = torch.rand(6, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    t1, lp1 = sample_token(logits, u, 0.7, 0.9)
    torch.manual_seed(123)  # the global RNG must not matter
    t2, lp2 = sample_token(logits, u.clone(), 0.7, 0.9)
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2)
    # a row's token depends on that row alone: the same row in another batch draws the same token
    t3, lp3 = sample_token(logits[2:4], u[2:4], 0.7, 0.9)
    assert torch.equal(t3, t1[2:4]) and torch.equal(lp3, lp1[2:4])


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    u = torch.rand(2000, generator=torch.Generator().manual_seed(0))
    draws = [int(sample_token(logits, u[i : i + 1], 1.0, 0.8)[0]) for i in range(2000)]
    assert set(draws) == {0, 1}
    # the nucleus is renormalised: 0.6 / 0.9 of the draws are token 0
    assert abs(draws.count(0) / 2000 - 2 / 3) < 0.04
    # u = 0 and the largest uniform torch.rand gives (1 - 2**-24) stay inside the support
    assert int(sample_token(logits, torch.tensor([0.0]), 1.0, 0.8)[0]) == 0
    assert int(sample_token(logits, torch.tensor([1.0 - 2**-24]), 1.0, 0.8)[0]) == 1
