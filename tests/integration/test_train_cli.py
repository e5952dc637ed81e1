"""`verlj train` end to end: bad input, local Hugging Face models, a reward model, learning."""

import hashlib
import json

import pytest

from verlj.journal import Journal
from verlj_testing import TINY, fingerprints, train, verlj


def tree_digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.name.endswith(".mdb") or p.name == "data.mdb":
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_one_line_error(out, code, text):
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and text in errors[0], out.stderr[-3000:]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "demo"
    out = train(run, "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_default_command_line_and_logs(finished_run):
    text = (finished_run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in text]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                 "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/step"):
        assert name in rows[0], name
    with Journal.open_reader(finished_run / "journal") as j:
        meta = j.meta.all()
    for key in ("config", "config_hash", "seed", "versions", "world_size", "num_threads"):
        assert key in meta
    assert set(meta["versions"]) >= {"torch", "deepspeed", "verlj"}
    assert (finished_run / "latest").resolve().name == "step_00002"
    md = json.loads((finished_run / "train_metadata.json").read_text())
    assert md["global_step"] == 2 and md["config_hash"] == meta["config_hash"]


def test_existing_run_is_refused_and_left_untouched(finished_run):
    before = tree_digest(finished_run)
    out = train(finished_run)
    assert_one_line_error(out, 1, "already holds a run; pass --resume")
    out = train(finished_run, "--output_dir", finished_run)  # the seed's spelling of the option
    assert out.returncode != 0
    assert tree_digest(finished_run) == before


def test_missing_model_directory(tmp_path):
    out = train(tmp_path / "r", "model.actor.model_name_or_path=/no/such/model")
    assert_one_line_error(out, 1, "model.actor.model_name_or_path: model directory /no/such/model does not exist")
    assert not (tmp_path / "r").exists()


def test_dataset_without_the_fields(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "solution": "2"}\n')
    out = train(tmp_path / "r", f"data.train_dataset={data}", "rollout.reward_fn=builtin:add")
    assert_one_line_error(out, 1, "lacks the fields 'prompt' and 'answer'")
    assert not (tmp_path / "r").exists()


def test_unknown_algorithm_and_bad_override(tmp_path):
    assert_one_line_error(train(tmp_path / "r", "algorithm.name=sac"), 2, "algorithm.name must be one of grpo, rloo, reinforce_plus_plus, ppo")
    assert_one_line_error(train(tmp_path / "r", "trainer.total_step=3"), 2, "did you mean 'trainer.total_steps'")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {total_steps: [}\n")
    assert_one_line_error(verlj("train", "--config", bad, "--output-dir", tmp_path / "r"), 2, "not valid YAML")
    assert not (tmp_path / "r").exists()


def test_bad_config_is_refused_before_torch_loads(tmp_path):
    """Config checks come before torch and DeepSpeed: here any import of torch fails loudly."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('verlj imported torch before checking its config')\n")
    out = train(tmp_path / "r", "trainer.total_step=3", PYTHONPATH=blocker)
    assert_one_line_error(out, 2, "did you mean 'trainer.total_steps'")
    assert not (tmp_path / "r").exists()
    # the same blocker does stop a valid config, at the first torch import
    out = train(tmp_path / "r", "trainer.total_steps=1", PYTHONPATH=blocker)
    assert out.returncode != 0 and "verlj imported torch before checking its config" in out.stdout + out.stderr


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    assert_one_line_error(train(tmp_path / "r", resume=True), 1, "is not a verlj run")
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["notes.txt"]


def save_tiny_hf(path, kind):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from verlj.engine.rl.models import builtin_tokenizer
    from verlj.engine.rl.vocab import VOCABS

    tok = builtin_tokenizer(VOCABS["digits"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         num_labels=1)
    torch.manual_seed(0)
    model = (LlamaForCausalLM if kind == "lm" else LlamaForSequenceClassification)(config)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def test_local_hf_actor_and_reward_model(tmp_path):
    save_tiny_hf(tmp_path / "actor", "lm")
    save_tiny_hf(tmp_path / "rm", "cls")
    run = tmp_path / "run"
    out = train(run, f"model.actor.model_name_or_path={tmp_path / 'actor'}",
                f"model.reward_model.model_name_or_path={tmp_path / 'rm'}", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    with Journal.open_reader(run / "journal") as j:
        samples = next(e for e in j.read_step(1).events if e["type"] == "buffer.add")["samples"]
    assert len(set(samples["rm_score"].tolist())) > 1  # the reward model scored every sample
    assert (samples["score"] == samples["rule_reward"] + samples["rm_score"]).all()
    assert len(fingerprints(run)) == 2


def test_default_run_learns(tmp_path, reference_run):
    """The README's default run (`verlj train --output-dir runs/demo`, 200 steps of the built-in task; trained once
    a session, test_guides reads it too): mean reward over the last 10 steps beats the first 10."""
    run = reference_run(tmp_path / "demo", [])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    r = [row["critic/score/mean"] for row in rows]
    assert len(r) == 200
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    assert last > first + 0.08, (first, last)


def test_checkpoint_policy_and_tensorboard(tmp_path):
    """trainer.checkpoint_policy names a class whose should_save decides; TensorBoard gets the metrics."""
    from verlj.engine.loop.run import train as run_train

    run = tmp_path / "r"
    run_train(run, None, [*TINY, "trainer.total_steps=12", "trainer.save_interval=0", "trainer.save_total_limit=0",
                          "trainer.checkpoint_policy=verlj.engine.snapshot.SaveOnRewardDrop", "logging.tensorboard=true"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    r = {row["step"]: row["critic/score/mean"] for row in rows}
    drops = {s for s in r if s > 1 and r[s] < r[s - 1] * 0.95}
    with Journal.open_reader(run / "journal") as j:
        saved = set(j.meta.snapshots())
    assert drops, "the run never dropped 5%: the check would be vacuous"
    assert saved == drops | {12}  # the final step is always saved
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_checkpoint_policy(tmp_path):
    out = train(tmp_path / "r", "trainer.checkpoint_policy=no.such.Policy")
    assert_one_line_error(out, 2, "trainer.checkpoint_policy: cannot import 'no.such.Policy'")  # code the config names: exit 2, as a wrong key


def test_wandb_offline_logs_every_step_and_a_resume_continues_the_same_run(tmp_path):
    """logging.wandb with WANDB_MODE=offline: no network; the offline run file holds each step's metrics."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    assert train(run, "trainer.total_steps=2", "logging.wandb=true", WANDB_MODE="offline").returncode == 0
    out = train(run, "trainer.total_steps=3", "logging.wandb=true", resume=True, WANDB_MODE="offline")
    assert out.returncode == 0, out.stderr[-2000:]
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len({f.name for f in files}) == 1  # one W&B run id for the verlj run, resumed
    data = b"".join(f.read_bytes() for f in files)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:  # wandb stores each value as its JSON text
        assert json.dumps(s["actor/pg_loss"]).encode() in data


def test_wandb_without_the_package_is_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        out = verlj("train", "--output-dir", tmp_path / "r", *TINY, "logging.wandb=true", PYTHONPATH=str(_no_wandb(tmp_path)))
    else:
        out = verlj("train", "--output-dir", tmp_path / "r", *TINY, "logging.wandb=true")
    assert out.returncode == 2 and "pip install 'verlj[wandb]' (in a checkout: pip install -e '.[wandb]')" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


def _no_wandb(tmp_path):
    """A directory that shadows the wandb package with one that fails to import."""
    d = tmp_path / "shadow"
    (d / "wandb").mkdir(parents=True)
    (d / "wandb" / "__init__.py").write_text("raise ImportError('wandb hidden for this test')\n")
    return d
