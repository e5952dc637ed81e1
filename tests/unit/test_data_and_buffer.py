import dataclasses
import json
import sys

import numpy as np
import pytest
import torch

from verlj.engine.config import DataConfig
from verlj.engine.errors import SnapshotError
from verlj.engine.rl.buffer import RolloutBuffer
from verlj.engine.rl.data import DataError, Example, Sampler, check_identity, load_data
from verlj.engine.rl.rewards import RewardError, add_reward, load_reward_fn, rule_rewards
from verlj.engine.rl.sampler import sample_token
from verlj.engine.schema.sample import FIELDS, Sample, pack, unpack
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
    a, b = load_data(cfg, 1), load_data(cfg, 1)
    assert a.identity == b.identity and a.held_out == []
    a, b = a.train, b.train
    assert a == b and len(a) == cfg.num_examples
    p, ans = a[0].prompt, a[0].answer
    x, y = p.rstrip("=").split("+")
    assert int(x) + int(y) == int(ans)


def test_jsonl_and_parquet_and_missing_fields(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    cfg = DataConfig(train_dataset=str(f), prompt_key="q", answer_key="a")
    assert load_data(cfg, 0).train[0].answer == "2"
    with pytest.raises(DataError, match="lacks the fields 'prompt' and 'answer'"):
        load_data(DataConfig(train_dataset=str(f)), 0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2+2="], "answer": ["4"]}), tmp_path / "d.parquet")
    assert load_data(DataConfig(train_dataset=str(tmp_path / "d.parquet")), 0).train[0].prompt == "2+2="
    with pytest.raises(DataError, match="does not exist"):
        load_data(DataConfig(train_dataset=str(tmp_path / "none.jsonl")), 0)


def sample(i, plen, rlen):
    rng = np.random.default_rng(i)
    return Sample(
        id=i, index=i * 3, group=i - i % 2, score=float(rng.standard_normal()), rule_reward=0.5, rm_score=0.0,
        policy_version=i // 2,
        prompt_ids=rng.integers(0, 50, plen), response_ids=rng.integers(0, 50, rlen),
        gen_logprobs=rng.standard_normal(rlen).astype(np.float32),
        ref_logprobs=rng.standard_normal(rlen).astype(np.float32),
    )


def test_pack_unpack_through_the_codec_is_exact():
    samples = [sample(i, 3 + i, 1 + 2 * i) for i in range(4)]
    back = unpack(unpackb(packb(pack(samples))))
    for a, b in zip(samples, back):
        for k in FIELDS:
            assert np.array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k))), k
        assert b.gen_logprobs.dtype == np.float32 and b.response_ids.dtype == np.int64


def test_buffer_ops_and_state():
    buf = RolloutBuffer()
    buf.add([sample(i, 2, 2) for i in range(6)])
    buf.drop([2, 3])
    taken = buf.consume([0, 1])
    assert [s.id for s in taken] == [0, 1] and list(buf.samples) == [4, 5] and buf.next_id == 6
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
    assert [s.policy_version for s in other.samples.values()] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a version-1 state (before plans and policy versions): no plans, versions unknown
    old = buf.state_dict()
    old["version"] = 1
    del old["plan_steps"], old["plans"]
    old["samples"] = {k: v for k, v in old["samples"].items() if k != "policy_version"}
    v1 = RolloutBuffer()
    v1.load_state_dict(unpackb(packb(old)))
    assert v1.plans == {} and {s.policy_version for s in v1.samples.values()} == {-1} and len(v1) == 8
    old["version"] = RolloutBuffer.VERSION + 1
    with pytest.raises(SnapshotError, match=f"version {RolloutBuffer.VERSION + 1}"):
        RolloutBuffer().load_state_dict(old)


def test_buffer_requests_leave_as_their_groups_arrive_and_survive_a_snapshot():
    """Completion order: the groups asked and not arrived are the buffer's, in the order asked."""
    buf = RolloutBuffer()
    buf.request([0, 2, 4], [7, 3, 9], group_size=2)
    assert buf.next_id == 6 and list(buf.requests.items()) == [(0, 7), (2, 3), (4, 9)]
    buf.add([dataclasses.replace(sample(i, 2, 3), group=2) for i in (2, 3)])
    assert list(buf.requests) == [0, 4] and len(buf) == 2
    with pytest.raises(AssertionError, match="requested twice"):
        buf.request([0], [1], group_size=2)
    other = RolloutBuffer()
    other.load_state_dict(unpackb(packb(buf.state_dict())))
    assert other.requests == buf.requests and list(other.requests) == [0, 4] and other.next_id == 6 and other.groups() == buf.groups()


def test_held_out_prompts_are_never_trained_on_and_the_identity_is_the_rows(tmp_path):
    """data.eval_size: generated rows after the training rows, none of whose prompts is trained on;
    a file's rows through data.eval_dataset; the identity's digest changes with the rows."""
    plain = load_data(DataConfig(), 1)
    held = load_data(DataConfig(eval_size=20), 1)
    out = {ex.prompt for ex in held.held_out}
    assert len(held.held_out) == 20 and out
    assert not out & {ex.prompt for ex in held.train}
    assert held.train == [ex for ex in plain.train if ex.prompt not in out]  # the same rows, less the held-out prompts
    assert held.identity["digest"] != plain.identity["digest"]
    check_identity(plain.identity, load_data(DataConfig(), 1).identity)
    check_identity(None, plain.identity)  # a run from before verlj recorded it
    with pytest.raises(DataError, match="differ from the ones this run started with"):
        check_identity(plain.identity, load_data(DataConfig(), 2).identity)
    f = tmp_path / "e.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    from_file = load_data(DataConfig(eval_dataset=str(f), eval_size=3), 1)
    assert [ex.answer for ex in from_file.held_out] == ["1", "2", "3"] and from_file.train == plain.train


def test_reasoning_gym_rows_scorer_and_refusals():
    """reasoning_gym:TASK rows are the task's items from the seed (several tasks: its composite); the
    task's own scorer judges the answer the response gives (text or <answer> tags); a task or config
    reasoning-gym does not know is one DataError."""
    from verlj.engine.rl.tasks import TaskScorer

    cfg = DataConfig(train_dataset="reasoning_gym:basic_arithmetic", eval_size=8)
    cfg.reasoning_gym.size = 50
    cfg.reasoning_gym.config = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"], "allow_negation": False,
                            "allow_parentheses": False}
    a, b = load_data(cfg, 7), load_data(cfg, 7)
    assert [ex.prompt for ex in a.train] == [ex.prompt for ex in b.train] and a.identity == b.identity
    assert a.identity["reasoning_gym"]["tasks"] == ["basic_arithmetic"] and a.identity["reasoning_gym"]["seed"] == 7
    assert len(a.held_out) <= 8 and a.held_out and all(ex.task == "basic_arithmetic" for ex in a.train)
    ex = a.train[0]
    x, y = ex.prompt.removeprefix("Calculate ").rstrip(".").split(" + ")
    assert ex.answer == str(int(x) + int(y))
    text, tags = TaskScorer(a.task_dataset, "text"), TaskScorer(a.task_dataset, "answer_tag")
    assert text.score(f" {ex.answer} ", ex.entry) == 1.0 and text.score("no", ex.entry) == 0.0
    assert tags.score(f"I think <answer>{ex.answer}</answer>", ex.entry) == 1.0 and tags.score(ex.answer, ex.entry) == 0.0
    assert rule_rewards(load_reward_fn("auto", cfg.train_dataset, a.task_dataset), [ex.prompt], [ex.answer], [ex]) == [1.0]
    assert load_data(DataConfig(train_dataset="reasoning_gym:basic_arithmetic", eval_size=8), 8).identity != a.identity
    mixed = DataConfig(train_dataset="reasoning_gym:basic_arithmetic,chain_sum")
    mixed.reasoning_gym.size, mixed.reasoning_gym.weights = 40, {"chain_sum": 3}
    tasks = [ex.task for ex in load_data(mixed, 1).train]
    assert set(tasks) == {"basic_arithmetic", "chain_sum"} and tasks.count("chain_sum") > tasks.count("basic_arithmetic")
    with pytest.raises(DataError, match="reasoning-gym has no task 'no_such_task'"):
        load_data(DataConfig(train_dataset="reasoning_gym:no_such_task"), 1)
    bad = DataConfig(train_dataset="reasoning_gym:basic_arithmetic")
    bad.reasoning_gym.config = {"min_terms": 0}
    with pytest.raises(DataError, match="reasoning-gym refused the config of basic_arithmetic"):
        load_data(bad, 1)
    bad.reasoning_gym.config = {"seed": 3}
    with pytest.raises(DataError, match="set seed with data.reasoning_gym.seed"):
        load_data(bad, 1)


def test_reasoning_gym_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(DataError, match=r"needs reasoning-gym: pip install 'verlj\[tasks\]'"):
        load_data(DataConfig(train_dataset="reasoning_gym:basic_arithmetic"), 1)


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
    assert rule_rewards(fn, ["1+1="], ["2"], [Example("1+1=", "2")]) == [0.5]
    with pytest.raises(RewardError, match=r"reward function my_rewards_ok.boom raised ValueError: no answer key \(prompt '1\+1='\)"):
        rule_rewards(load_reward_fn("my_rewards_ok:boom"), ["1+1="], ["2"], [Example("1+1=", "2")])
    with pytest.raises(RewardError, match="my_rewards_ok:two .* has the wrong signature"):
        load_reward_fn("my_rewards_ok:two")
    with pytest.raises(RewardError, match="returned 'high'.*must return a finite number"):
        rule_rewards(load_reward_fn("my_rewards_ok:text"), ["1+1="], ["2"], [Example("1+1=", "2")])
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


VERL_ROWS = [
    {"data_source": "openai/gsm8k", "ability": "math",
     "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+{i}? Output the final answer after \"####\"."}],
     "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"split": "train", "index": i}}
    for i in range(3)
]


def _builtin_render(messages):
    from verlj.engine.rl.models import render_chat

    return render_chat(None, messages, builtin=True)


def test_chat_prompts_render_with_the_template_and_dotted_keys_reach_nested_fields(tmp_path):
    """verl's parquet rows: a list of messages rendered by the built-in template, the answer at
    reward_model.ground_truth, data_source and extra_info kept for compute_score; a string row's
    prompt is the string itself, as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), f)
    cfg = DataConfig(train_dataset=str(f), prompt_key="prompt", answer_key="reward_model.ground_truth")
    ex = load_data(cfg, 0, render=_builtin_render).train[1]
    assert ex.prompt == '<|system|>\nBe brief.\n<|user|>\n1+1? Output the final answer after "####".\n<|assistant|>\n'
    assert ex.answer == "2" and ex.data_source == "openai/gsm8k" and ex.extra_info == {"split": "train", "index": 1}
    assert ex.messages[0] == (("role", "system"), ("content", "Be brief."))
    with pytest.raises(DataError, match="is a chat prompt and nothing renders it"):
        load_data(cfg, 0)
    # a Hugging Face tokenizer's own template (apply_chat_template, with the generation prompt)
    from verlj.engine.rl.models import builtin_tokenizer, render_chat
    from verlj.engine.rl.vocab import VOCABS

    tok = builtin_tokenizer(VOCABS["ascii"])
    with pytest.raises(DataError, match="row 0 of .*verl.parquet: its prompt is a list of chat messages but the model's tokenizer has no chat template"):
        load_data(cfg, 0, render=lambda m: render_chat(tok, m, builtin=False))
    tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    ex = load_data(cfg, 0, render=lambda m: render_chat(tok, m, builtin=False)).train[0]
    assert ex.prompt == '[system] Be brief.\n[user] 0+0? Output the final answer after "####".\n[assistant] '
    # JSONL too; a string prompt is untouched by the renderer, and a key with dots in its own name wins
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"prompt": "3+4=", "a.b": "7", "a": {"b": "no"}}) + "\n")
    ex = load_data(DataConfig(train_dataset=str(j), answer_key="a.b"), 0, render=_builtin_render).train[0]
    assert (ex.prompt, ex.answer, ex.messages) == ("3+4=", "7", None)


@pytest.mark.parametrize("row, keys, message", [
    ({"prompt": [{"role": "user"}], "answer": "1"}, {}, r"row 0 of .*: chat message 0 must be \{\"role\": str, \"content\": str\}, got \{'role': 'user'\}"),
    ({"prompt": [{"content": "hi"}], "answer": "1"}, {}, r"row 0 of .*: chat message 0 must be"),
    ({"prompt": [], "answer": "1"}, {}, r"row 0 of .*: its prompt is an empty list of chat messages"),
    ({"prompt": "1+1=", "reward_model": {"style": "rule"}}, {"answer_key": "reward_model.ground_truth"},
     r"row 0 of .* has no field 'reward_model.ground_truth' \(data.answer_key: a dotted path"),
    ({"q": {"text": "1+1="}, "answer": "2"}, {"prompt_key": "q.body"}, r"row 0 of .* has no field 'q.body' \(data.prompt_key"),
    ({"prompt": {"role": "user", "content": "1+1="}, "answer": "2"}, {},
     r"row 0 of .*: its prompt \('prompt'\) is a dict; it must be a string or a list of chat messages"),
    ({"prompt": "1+1=", "answer": None}, {}, r"row 0 of .*: its answer \('answer'\) is null; it must be a string or a number"),
    ({"prompt": "1+1=", "reward_model": {"ground_truth": None}}, {"answer_key": "reward_model.ground_truth"},
     r"row 0 of .*: its answer \('reward_model.ground_truth'\) is null"),
])
def test_bad_chat_rows_and_missing_dotted_keys_are_one_line(tmp_path, row, keys, message):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "0+0=", "answer": "0", "reward_model": {"ground_truth": "0"}, "q": {"body": "x"}}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message.replace("row 0", "row 1")) as e:
        load_data(DataConfig(train_dataset=str(f), **keys), 0, render=_builtin_render)
    assert "\n" not in str(e.value) and str(f) in str(e.value)


def test_compute_score_rewards_take_verls_keywords(tmp_path, monkeypatch):
    """A function named like verl's compute_score(data_source, solution_str, ground_truth, extra_info)
    is called with keywords from the row; {"score": x} scores x; one naming another parameter is refused."""
    (tmp_path / "verl_style_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'openai/gsm8k' and extra_info['index'] == 4, (data_source, extra_info)\n"
        "    return 1.0 if solution_str.split('####')[-1].strip() == ground_truth else 0.25\n"
        "def as_dict(solution_str, ground_truth, **kw):\n    return {'score': 0.5 + len(kw), 'acc': True}\n"
        "def partial(solution_str, ground_truth):\n    return 0.75\n"
        "def odd(solution_str, ground_truth, tokenizer):\n    return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ex = Example("p", "8", data_source="openai/gsm8k", extra_info={"index": 4})
    fn = load_reward_fn("verl_style_rewards:compute_score")
    assert rule_rewards(fn, ["p", "p"], ["so #### 8", "#### 9"], [ex, ex]) == [1.0, 0.25]
    assert rule_rewards(load_reward_fn("verl_style_rewards:as_dict"), ["p"], ["x"], [ex]) == [2.5]
    assert rule_rewards(load_reward_fn("verl_style_rewards:partial"), ["p"], ["x"], [ex]) == [0.75]
    with pytest.raises(RewardError, match=r"verl_style_rewards:odd \(called as compute_score\(data_source=, .*has the wrong signature"):
        load_reward_fn("verl_style_rewards:odd")
    with pytest.raises(RewardError, match=r"reward function verl_style_rewards.compute_score raised AssertionError"):
        rule_rewards(fn, ["p"], ["x"], [Example("p", "8")])
