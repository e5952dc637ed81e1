"""reasoning-gym tasks end to end: a run killed (SIGKILL at a failpoint) and resumed is bit-exact,
held-out eval included; a changed task config or changed prompts on resume are refused."""

import json

import numpy as np
import pytest

from verlj.engine.loop.run import train as run_train
from verlj.journal import open_journal_reader
from verlj_testing import TINY, assert_same_journal, train

TASK = [
    "data.train_dataset=reasoning_gym:spell_backward,basic_arithmetic",
    "data.reasoning_gym.size=60",
    "data.reasoning_gym.config={spell_backward: {min_word_len: 3, max_word_len: 3}, basic_arithmetic: {max_terms: 2, max_digits: 1}}",
    "data.eval_size=6",
    "data.max_prompt_length=64",
    "trainer.eval_interval=2",
    "trainer.total_steps=6",
    "trainer.save_interval=4",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("tasks") / "ref"
    run_train(run, None, [*TINY, *TASK])
    return run


def assert_one_line_error(out, code, text):
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in out.stderr and len(errors) == 1 and text in errors[0], out.stderr[-3000:]


def test_a_killed_reasoning_gym_run_resumes_exactly_with_its_eval(tmp_path, reference):
    with open_journal_reader(reference / "journal") as j:
        steps = {rec.step: rec for rec in j.iter_steps()}
    evals = {s: rec.first("eval") for s, rec in steps.items() if rec.first("eval") is not None}
    assert sorted(evals) == [2, 4, 6]
    for s, e in evals.items():
        metrics = steps[s].metrics
        assert len(e["rows"]) == len(e["scores"]) == len(e["response_len"]) and e["response_len"].sum() == len(e["response_ids"])
        assert metrics["eval/score/mean"] == pytest.approx(float(np.mean(e["scores"])))
        tasks = [k for k in metrics if k.startswith("eval/score/") and k != "eval/score/mean"]
        assert tasks and set(tasks) <= {"eval/score/spell_backward/mean", "eval/score/basic_arithmetic/mean"}
    assert "eval/score/mean" not in steps[3].metrics

    run = tmp_path / "run"
    out = train(run, *TASK, VERLJ_FAILPOINT="step.before_commit:4")  # step 4 trained and evaluated, not journaled
    assert out.returncode == -9, out.stderr[-3000:]
    out = train(run, *TASK, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(run, reference)  # every event, eval rows, responses and scores included

    # the task's config is part of what the run is: a resume that changes it is refused, nothing written
    before = sorted(p.name for p in run.iterdir())
    changed = [t.replace("min_word_len: 3, max_word_len: 3", "min_word_len: 4, max_word_len: 4") for t in TASK]
    out = train(run, *changed, "trainer.total_steps=8", resume=True)
    assert_one_line_error(out, 2, "data.reasoning_gym.config.spell_backward.max_word_len, "
                                  "data.reasoning_gym.config.spell_backward.min_word_len cannot change within a run (resume)")
    assert sorted(p.name for p in run.iterdir()) == before


def test_changed_prompts_on_resume_are_refused(tmp_path):
    """The run's identity holds a digest of its prompts: a data file edited between two sessions is
    named, not trained on."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10)))
    over = [f"data.train_dataset={data}", "rollout.reward_fn=builtin:add", "trainer.total_steps=2"]
    run = tmp_path / "run"
    assert train(run, *over).returncode == 0
    data.write_text(data.read_text().replace('"answer": "4"', '"answer": "5"'))
    out = train(run, *over, "trainer.total_steps=3", resume=True)
    assert_one_line_error(out, 1, f"the prompts of {data} differ from the ones this run started with")


def test_verl_format_chat_parquet_trains_with_a_compute_score_reward(tmp_path):
    """verl's GSM8K-style parquet unchanged: chat-message prompts rendered by the built-in template (their
    tokens journaled), the answer at reward_model.ground_truth, and a compute_score(data_source,
    solution_str, ground_truth, extra_info) reward whose scores are the journal's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verlj.engine.rl.vocab import SPECIALS, VOCABS, TextDecoder, builtin_vocab
    from verlj.engine.schema.sample import unpack

    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"{i}+{i}? Answer after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "question": f"{i}+{i}?"}} for i in range(3)]
    data = tmp_path / "gsm8k_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "verl_gsm8k_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'openai/gsm8k', data_source\n"
        "    return (1.0 if ground_truth in solution_str else 0.0) + 0.01 * len(solution_str) + 0.1 * extra_info['index']\n"
    )
    run = tmp_path / "run"
    out = train(run, f"data.train_dataset={data}", "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth",
                "data.max_prompt_length=64", "rollout.reward_fn=verl_gsm8k_reward:compute_score", "trainer.total_steps=2",
                PYTHONPATH=mod)
    assert out.returncode == 0, out.stderr[-3000:]
    vocab, decoder = builtin_vocab(VOCABS["ascii"]), TextDecoder("builtin:tiny", VOCABS["ascii"])
    texts = [f"<|user|>\n{i}+{i}? Answer after \"####\".\n<|assistant|>\n" for i in range(3)]
    seen = set()
    with open_journal_reader(run / "journal") as j:
        for step in (1, 2):
            for s in unpack(j.read_step(step).first("buffer.add")["samples"]):
                i = s.index
                assert s.prompt_ids.tolist() == [vocab["<bos>"]] + [vocab[c] for c in texts[i]]
                assert decoder.decode(s.prompt_ids.tolist()) == texts[i]
                response = decoder.decode(s.response_ids.tolist())
                want = (1.0 if str(2 * i) in response else 0.0) + 0.01 * len(response) + 0.1 * i
                assert s.rule_reward == s.score == want, (i, response)
                seen.add(i)
    assert seen == {0, 1, 2} and SPECIALS[1] == "<bos>"


def test_chat_prompts_on_a_real_tokenizer_are_rendered_by_its_template(tmp_path, bpe_model):
    """A chat-message dataset on the bpe_model: each prompt is its messages through the model's ChatML template, tokenized
    once (no <bos>: the tokenizer has none), the generation prompt last."""
    from transformers import AutoTokenizer

    from verlj.engine.schema.sample import unpack

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}="}],
                                        "answer": str(2 * i)}) + "\n" for i in range(4)))
    run = tmp_path / "run"
    out = train(run, f"data.train_dataset={data}", f"model.actor.model_name_or_path={bpe_model}", "rollout.reward_fn=builtin:add",
                "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(bpe_model, local_files_only=True)
    with open_journal_reader(run / "journal") as j:
        samples = [s for step in (1, 2) for s in unpack(j.read_step(step).first("buffer.add")["samples"])]
    for s in samples:
        text = f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{s.index}+{s.index}=<|im_end|>\n<|im_start|>assistant\n"
        assert s.prompt_ids.tolist() == tok(text, add_special_tokens=False).input_ids
    assert {s.index for s in samples} == {0, 1, 2, 3}
