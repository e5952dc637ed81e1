"""`verlj export RUN --sft/--dpo` on real runs (the default task, an environment's episodes, an agent program):
every export, with and without token ids, in each format, loads with `datasets` and verifies against its run; its
rows are the journal's samples (ids, labels masked where the loss mask is 0, the chain hash of their step); a
changed, removed or reordered row is named by `verify --against`; the filters choose what they say; TRL's
SFTTrainer trains a step on the SFT rows (text and ids) and DPOTrainer a step on the pairs; bad usage is one line
and never touches an existing directory. One run of each kind for the module; a damaged step is left out and said."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from journal_helpers import raw_get, raw_put, tamper
from verlj.engine.post_mortem.distill_files import Manifest, read_manifest
from verlj.engine.rl.gateway.token_ledger import trained_chat
from verlj.engine.schema.agent_calls import AgentCalls
from verlj.engine.schema.events import StepEvents
from verlj.engine.schema.sample import unpack
from verlj.journal import open_journal_reader
from verlj_testing import TINY, cli

TESTS = str(Path(__file__).resolve().parents[1])  # envs_for_tests, agents_for_tests
ENV = ["rollout.env=envs_for_tests:Digits", "rollout.max_turns=3", "model.tiny.vocab=ascii"]
AGENT = ["rollout.agent=agents_for_tests:digits", "rollout.max_turns=2", "model.tiny.vocab=ascii"]
DATA = "data/train-00000-of-00001"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, reference_run):
    """The default task's run (test_restarts's reference, trained once)."""
    return reference_run(tmp_path_factory.mktemp("default") / "run", TINY, {})


@pytest.fixture(scope="module")
def env_run(tmp_path_factory, reference_run):
    return reference_run(tmp_path_factory.mktemp("env") / "run", [*TINY, *ENV], {"PYTHONPATH": TESTS})


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, reference_run):
    """An agent program's run (test_agents's agent_ref, trained once)."""
    return reference_run(tmp_path_factory.mktemp("agent") / "run", [*TINY, *AGENT], {"PYTHONPATH": TESTS})


def journal_samples(run: Path) -> dict[tuple[int, int], object]:
    """(step, sample id) -> the Sample, and step -> its record's chain hash, from the journal."""
    out: dict = {}
    with open_journal_reader(run / "journal") as j:
        for rec in j.iter_steps():
            out[rec.step] = j.chain_hash(rec.step)
            for s in unpack(StepEvents.of(rec).added.samples):
                out[rec.step, s.id] = s
    return out


def export(run: Path, out: Path, *args: str) -> Manifest:
    said = cli("export", run, "-o", out, *args, check=True)
    assert said.stdout.startswith("wrote ") and f"verlj verify {out} --against {run}" in said.stdout
    return read_manifest(out)


def load(out: Path, fmt: str):
    import datasets

    if fmt == "arrow":
        return datasets.load_from_disk(str(out))
    by_card = datasets.load_dataset(str(out), split="train")  # the standard layout, found by itself
    by_files = datasets.load_dataset("parquet" if fmt == "parquet" else "json", data_files=str(out / "data/train-*"), split="train")
    a, b = by_card.to_list(), by_files.to_list()
    assert a == b, [(k, x[k], y[k]) for x, y in zip(a, b) for k in x if x[k] != y[k]][:3]
    return by_files


def check_sft_rows(rows: list[dict], run: Path, conversational: bool) -> None:
    held = journal_samples(run)
    assert sorted((r["step"], r["sample_id"]) for r in rows) == sorted(k for k in held if isinstance(k, tuple))  # nothing faulted here
    for r in rows:
        s = held[r["step"], r["sample_id"]]
        assert (r["chain"], r["policy_version"], r["score"], r["group"], r["index"]) == (held[r["step"]], s.policy_version, s.score, s.group, s.index)
        mask = s.policy_mask() > 0
        assert r["input_ids"] == s.prompt_ids.tolist() + s.response_ids.tolist()
        assert r["labels"] == [-100] * len(s.prompt_ids) + np.where(mask, s.response_ids, -100).tolist()
        assert r["gen_logprobs"] == [0.0] * len(s.prompt_ids) + np.where(mask, s.gen_logprobs, 0).astype(np.float32).tolist()
        if not conversational:
            assert set(r) >= {"prompt", "completion"} and "messages" not in r
            continue
        trained = [m for m in r["messages"] if m["weight"] == 1]
        assert all(m["role"] == "assistant" for m in trained) and r["messages"][0]["weight"] == 0
        if s.agent_calls:  # the trained chain's answers, as the gateway answered them
            conv = trained_chat(s.agent_calls)
            assert [m["content"] for m in trained] == [conv.messages[k].content for k in sorted(conv.trained)]
            assert len(trained) == len(AgentCalls.from_json(s.agent_calls).trained)  # every call of the chain found
        else:  # one assistant message an action, an observation after it (user) when the env said one
            assert len(trained) == len(s.turns()) == len(s.turn_lens) // 2


@pytest.mark.parametrize("which", ["default", "env", "agent"])
def test_every_export_of_each_kind_of_run_loads_with_datasets_and_verifies_against_its_run(which, request, tmp_path):
    run = request.getfixturevalue(f"{which}_run")
    conversational = which != "default"
    for fmt in ("parquet", "jsonl", "arrow"):
        out = tmp_path / f"sft-{fmt}"
        manifest = export(run, out, "--sft", "--tokens", "--format", fmt)
        rows = load(out, fmt).to_list()
        assert len(rows) == manifest.rows == manifest.files[0].rows == 64
        assert list(rows[0]) == manifest.columns and rows[0]["run"] == "run"
        check_sft_rows(rows, run, conversational)
        assert cli("verify", out, "--against", run).returncode == 0
    out = tmp_path / "dpo"
    manifest = export(run, out, "--dpo", "--tokens")
    pairs = load(out, "parquet").to_list()
    held = journal_samples(run)
    assert pairs and len(pairs) == manifest.rows
    for p in pairs:
        c, r = held[p["step"], p["chosen_sample_id"]], held[p["step"], p["rejected_sample_id"]]
        assert c.group == r.group == p["group"] and np.array_equal(c.prompt_ids, r.prompt_ids) and p["prompt_ids"] == c.prompt_ids.tolist()
        assert (p["score_chosen"], p["score_rejected"]) == (c.score, r.score) and c.score > r.score
        assert (p["chosen_ids"], p["rejected_ids"]) == (c.response_ids.tolist(), r.response_ids.tolist())
        assert p["chosen_loss_mask"] == c.policy_mask().astype(int).tolist() and p["chain"] == held[p["step"]]
        if conversational:
            assert [m["role"] for m in p["prompt"]][-1] == "user" and p["chosen"][0]["role"] == "assistant"
        else:
            assert isinstance(p["prompt"], str) and isinstance(p["chosen"], str)
    # best against worst: one pair per group with scores that differ (every group of one prompt here but the env's)
    if which == "default":
        groups = {}
        for k, s in held.items():
            if isinstance(k, tuple):
                groups.setdefault((k[0], s.group), []).append(s.score)
        assert len(pairs) == sum(max(v) > min(v) for v in groups.values())
    assert cli("verify", out, "--against", run).returncode == 0


def rewrite_parquet(path: Path, change) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table.to_pylist()
    change(rows)
    pq.write_table(type(table).from_pylist(rows, table.schema), path)


def test_a_changed_removed_or_reordered_row_is_named_by_verify_against(default_run, env_run, tmp_path):
    out = tmp_path / "sft"
    export(default_run, out, "--sft", "--tokens")

    def change(rows):
        rows[2]["completion"] += "1"
        rows[9]["input_ids"][-1] += 1
        rows[20]["chain"] = "0" * 64
        del rows[30]
        rows[40], rows[41] = rows[41], rows[40]

    rewrite_parquet(out / f"{DATA}.parquet", change)
    said = cli("verify", out, "--against", default_run)
    assert said.returncode == 1
    lines = said.stdout.splitlines()
    f = f"{DATA}.parquet"
    assert f"  {f}: its size or BLAKE3 digest differs from the manifest's (the file was changed)" in lines
    assert f"  row 3 of {f} (step 1, sample 2): completion differs from the journal" in lines
    assert f"  row 10 of {f} (step 1, sample 9): input_ids differs from the journal" in lines
    assert f"  row 21 of {f} (step 2, sample 20): chain differs from the journal" in lines
    assert "  step 2, sample 30: a row the export lacks (the journal holds it, and the filter makes it)" in lines
    # samples 42 then 41: 41 is missed where it belonged, and out of order where it is
    assert "  step 3, sample 41: a row the export lacks (the journal holds it, and the filter makes it)" in lines
    assert f"  row 42 of {f} (step 3, sample 41): out of order: an export's rows come in step order, then by sample, once each" in lines
    assert "✗ 6 rows are not what the journal holds (of 63 read, 59 checked)" in lines
    assert lines[-1] == "CHANGED: the export is not what the run's journal holds (each row named above)"
    said = cli("verify", out, "--against", env_run)  # checked against another run: said at once, no row read
    assert said.returncode == 1 and said.stdout.splitlines()[1].startswith(f"✗ {out} was exported from another run (made ")


def test_the_filters_choose_what_they_say(default_run, tmp_path):
    held = journal_samples(default_run)
    samples = [s for k, s in held.items() if isinstance(k, tuple)]
    rows = lambda out: load(out, "parquet").to_list()  # noqa: E731
    m = export(default_run, tmp_path / "min", "--sft", "--min-score", "0.1")
    assert {r["sample_id"] for r in rows(tmp_path / "min")} == {s.id for s in samples if s.score >= 0.1}
    assert m.counts.below_min_score == sum(s.score < 0.1 for s in samples) and m.filter.min_score == 0.1
    export(default_run, tmp_path / "best", "--sft", "--best-of-group", "--steps", "2:3")
    best = {}
    for k, s in held.items():
        if isinstance(k, tuple) and 2 <= k[0] <= 3:
            best.setdefault(s.group, []).append(s)
    assert [r["sample_id"] for r in rows(tmp_path / "best")] == sorted(min(g, key=lambda s: (-s.score, s.id)).id for g in best.values())
    m = export(default_run, tmp_path / "dedupe", "--sft", "--dedupe")
    texts = [(r["prompt"], r["completion"]) for r in rows(tmp_path / "dedupe")]
    assert len(texts) == len(set(texts)) == 64 - m.counts.duplicates
    m = export(default_run, tmp_path / "pairs", "--dpo", "--all-pairs", "--margin", "0.05")
    assert all(p["score_chosen"] - p["score_rejected"] >= 0.05 for p in rows(tmp_path / "pairs")) and m.rows > 0
    export(default_run, tmp_path / "chat", "--sft", "--messages", "--steps", "1:1")  # single-turn samples as conversations
    export(default_run, tmp_path / "plain", "--sft", "--steps", "1:1")
    chats, plain = rows(tmp_path / "chat"), rows(tmp_path / "plain")
    assert [r["sample_id"] for r in chats] == [r["sample_id"] for r in plain] and "prompt" not in chats[0]
    for r, p in zip(chats, plain):
        assert [(m["role"], m["content"], m["weight"]) for m in r["messages"]] == [("user", p["prompt"], 0), ("assistant", p["completion"], 1)]
    for name in ("min", "best", "dedupe", "pairs", "chat"):
        assert cli("verify", tmp_path / name, "--against", default_run).returncode == 0, name


def tiny_llama(vocab: str):
    import torch
    from transformers import LlamaForCausalLM

    from verlj.engine.config import TinyModelConfig
    from verlj.engine.rl.models import builtin_tokenizer, tiny_llama_config
    from verlj.engine.rl.vocab import VOCABS

    tok = builtin_tokenizer(VOCABS[vocab])
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(TinyModelConfig(), len(tok), 256)), tok


def one_step(trainer_cls, config_cls, data, tmp_path, **kw) -> float:
    """One optimizer step of a TRL trainer on `data` with the built-in tiny model: its loss, checked finite, and
    every trained weight checked moved."""
    import torch

    model, tok = tiny_llama(kw.pop("vocab"))
    before = [p.detach().clone() for p in model.parameters()]
    args = config_cls(output_dir=str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=8, report_to="none", use_cpu=True,
                      save_strategy="no", max_length=256, learning_rate=1e-3)
    out = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tok, **kw).train()
    assert math.isfinite(out.training_loss) and out.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return out.training_loss


def test_trl_trains_a_step_on_the_sft_rows_as_text_and_as_ids_and_a_dpo_step_on_the_pairs(default_run, env_run, tmp_path):
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    export(default_run, tmp_path / "text", "--sft")
    export(default_run, tmp_path / "ids", "--sft", "--tokens")
    export(env_run, tmp_path / "env", "--sft", "--tokens")  # the observations' labels -100: trained on the policy's tokens only
    export(default_run, tmp_path / "dpo", "--dpo")
    text = one_step(SFTTrainer, SFTConfig, load(tmp_path / "text", "parquet"), tmp_path, vocab="digits")
    ids = one_step(SFTTrainer, SFTConfig, load(tmp_path / "ids", "parquet"), tmp_path, vocab="digits")
    one_step(SFTTrainer, SFTConfig, load(tmp_path / "env", "parquet"), tmp_path, vocab="ascii")
    assert text > 0 and ids > 0
    ref, _ = tiny_llama("digits")
    dpo = one_step(DPOTrainer, DPOConfig, load(tmp_path / "dpo", "parquet"), tmp_path, vocab="digits", ref_model=copy.deepcopy(ref))
    assert dpo == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as its reference: -log sigmoid(0)


def test_bad_usage_is_one_line_and_never_touches_a_directory_that_is_not_an_export(default_run, tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    cases = [(["--sft", "--dpo"], "--sft and --dpo: export one at a time"),
             (["--sft", "--turns"], "--turns writes the rollout table a row per turn"),
             (["--dpo", "--best-of-group"], "--best-of-group chooses SFT rows"),
             (["--sft", "--margin", "1"], "--all-pairs and --margin choose preference pairs"),
             (["--rollouts", "--tokens"], "--tokens chooses --sft or --dpo rows"),
             (["--sft", "--format", "csv"], "--format must be one of parquet, jsonl, arrow")]
    for args, says in cases:
        out = cli("export", default_run, "-o", keep, *args)
        assert out.returncode != 0 and out.stderr.startswith("error: ") and says in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr
    out = cli("export", default_run, "-o", tmp_path / "none", "--sft", "--steps", "9:")
    assert out.returncode == 2 and "--steps selects no step: this run has steps 1–4" in out.stderr and not (tmp_path / "none").exists()
    out = cli("export", default_run, "-o", keep, "--sft")
    assert out.returncode == 2 and "holds files and is not an export of `verlj export --sft/--dpo` (no export manifest.json)" in out.stderr
    assert [p.name for p in keep.iterdir()] == ["notes.txt"]
    # an export is replaced by the next one; verify without --against, or --against given a run's directory as the export
    first = export(default_run, tmp_path / "e", "--sft", "--steps", "1:1")
    again = export(default_run, tmp_path / "e", "--sft", "--steps", "2:2")
    assert (first.rows, again.filter.first) == (16, 2) and not list(tmp_path.glob(".e.*"))
    said = cli("verify", tmp_path / "e")
    assert said.returncode == 2 and "is an export (verlj export --sft/--dpo); say which run to check its rows against: --against RUN" in said.stderr
    said = cli("verify", default_run, "--against", default_run)
    assert said.returncode == 2 and "is not an export of `verlj export --sft/--dpo`: manifest.json is missing" in said.stderr
    said = cli("verify", tmp_path / "e", "--against", tmp_path / "e")
    assert said.returncode == 2 and f"--against {tmp_path / 'e'} is not a verlj run (no journal/ with run metadata)" in said.stderr
    said = cli("verify", tmp_path / "e", "--against", default_run, "--json")
    report = json.loads(said.stdout)
    assert said.returncode == 0 and report["ok"] and report["rows"] == 16 and report["problems"] == []


def test_no_export_writes_into_a_run_and_the_folders_of_its_output_are_made(default_run, tmp_path):
    """A run's own files are never replaced (metrics.jsonl, a snapshot's directory), nor is anything written beside them,
    whichever run the path lies in; an output in folders that do not exist yet is written there (the datasets guide's
    `-o out/sft`), and a refused export leaves no folder behind."""
    run = tmp_path / "run"
    shutil.copytree(default_run, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    snapshot = next(p for p in sorted(run.iterdir()) if p.name.startswith("step_"))
    for args, where in ((["--rollouts", "-o", run / "metrics.jsonl"], run / "metrics.jsonl"),
                        (["--rollouts", "-o", snapshot / "rows.parquet"], snapshot / "rows.parquet"),
                        (["--sft", "-o", snapshot], snapshot), (["--dpo", "-o", run / "new" / "pairs"], run / "new" / "pairs"),
                        (["--sft", "-o", run], run)):
        out = cli("export", default_run, *args)
        what = "is the run directory" if where == run else f"is inside the run directory {run.resolve()}"
        assert out.returncode == 2 and out.stderr == f"error: --output {where} {what}: verlj never writes what a command makes into a " \
            "run, where it could replace or be taken for one of the run's own files; name a path outside it\n", out.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before and not (run / "new").exists()
    # the guide's outputs, in folders made as needed
    assert export(default_run, tmp_path / "out" / "sft", "--sft", "--steps", "1:1").rows == 16
    said = cli("export", default_run, "--rollouts", "-o", tmp_path / "tables" / "all.jsonl", "--steps", "1:1", check=True)
    assert said.stdout == f"wrote 16 samples to {tmp_path / 'tables' / 'all.jsonl'}\n"
    out = cli("export", default_run, "--sft", "--min-score", "1000", "-o", tmp_path / "deep" / "er" / "sft")
    assert out.returncode == 1 and "nothing to write" in out.stderr and not (tmp_path / "deep").exists(), out.stderr


def test_an_export_of_a_run_with_a_damaged_step_warns_and_leaves_it_out(default_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(default_run, run)

    def flip(txn, db):
        raw = bytearray(raw_get(txn, db, 2))
        raw[-3] ^= 0xFF
        raw_put(txn, db, 2, bytes(raw))

    tamper(run / "journal", flip)
    said = cli("export", run, "-o", tmp_path / "sft", "--sft")
    assert said.returncode == 0 and said.stdout.startswith("wrote 48 rows")
    assert said.stderr == (f"warning: step 2 is damaged in the journal (its stored bytes do not match its checksum): its samples are left out; "
                           f"run `verlj verify {run}`\n")
    assert read_manifest(tmp_path / "sft").left_out.damaged == {2: "its stored bytes do not match its checksum"}
    assert sorted({r["step"] for r in load(tmp_path / "sft", "parquet").to_list()}) == [1, 3, 4]
    said = cli("verify", tmp_path / "sft", "--against", run)
    assert said.returncode == 0 and "note: step 2 was left out of the export: it was damaged (its stored bytes do not match its checksum)" in said.stdout
