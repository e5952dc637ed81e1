"""export --sft/--dpo's rows (post_mortem.distill) on samples made here: an agent episode's trained chain as a chat
(tool calls and results kept, the messages outside the chain weight 0), an episode turn by turn (observations
masked), the filter (faults never, --min-score, --best-of-group, pairs within one prompt, --margin, never equal), the
token columns (labels -100 exactly where the loss mask is 0); StepReader.chained on a real LMDB journal (a damaged
record said, the walk going on); and an export of a long journal in flat memory, streamed."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from verlj.engine.config import make_config
from verlj.engine.errors import UsageError
from verlj.engine.loop.ledger import Ledger
from verlj.engine.loop.reader import StepReader
from verlj.engine.post_mortem.distill import DPO, IGNORE, SFT, Counts, Form, Item, Spec, chat_of, choose_pairs, choose_sft, sft_row
from verlj.engine.post_mortem.distill_files import export_dataset, file_rows, read_manifest
from verlj.engine.post_mortem.distill_verify import verify_export
from verlj.engine.rl.gateway.protocol import Completion, Message, ToolCall, parse_request, response_bytes
from verlj.engine.rl.gateway.token_ledger import ledger_of, trained_chat
from verlj.engine.schema.agent_calls import AgentCalls, Call
from verlj.engine.schema.events import Added
from verlj.engine.schema.sample import EnvEnd, Sample, pack
from verlj.journal import Journal, make_event
from verlj.journal.frames import step_key

MODEL = "m"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def call(messages: list, text: str, prompt: list, completion: list, tools: bool = False) -> Call:
    body = {"model": MODEL, "messages": messages, **({"tools": TOOLS} if tools else {})}
    req = parse_request(json.dumps(body).encode(), MODEL)
    resp, flag = response_bytes(req, Completion(text, [], [], "stop", len(prompt), len(completion)), "c0")
    return Call(req.canonical(), req.digest(), np.asarray(prompt), np.asarray(completion), np.full(len(completion), -0.5, np.float32), resp, flag)


def tool_episode(trained: tuple[int, ...] | None = None) -> tuple[AgentCalls, list]:
    """A tool call, its result sent back, the final answer (one chain, trained); then a call that rewrote the history
    (`trained`: the calls trained instead)."""
    sent = [{"role": "user", "content": "2+3="}]
    first = call(sent, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', [1, 5], [6, 7], tools=True)
    asked = json.loads(first.response)["choices"][0]["message"]["tool_calls"]
    back = [*sent, {"role": "assistant", "content": None, "tool_calls": asked}, {"role": "tool", "tool_call_id": asked[0]["id"], "content": "5"}]
    second = call(back, "it is 5", [1, 5, 6, 7, 9], [8, 2], tools=True)
    rewritten = call([*back, {"role": "assistant", "content": "it is 5"}, {"role": "user", "content": "sure?"}], "yes", [1, 4], [3, 2])
    calls = ledger_of([first, second, rewritten], 1.0)
    assert calls.trained == (0, 1) and calls.segments == 2
    return (calls if trained is None else AgentCalls(calls.calls, trained, 1.0, 2)), asked


def test_an_agent_episode_is_its_trained_chain_as_a_chat_with_its_tool_calls_and_results():
    calls, asked = tool_episode()
    conv = trained_chat(calls.to_json())
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1] == Message("assistant", None, (ToolCall(asked[0]["id"], "add", '{"a": 2, "b": 3}'),))
    assert conv.messages[2] == Message("tool", "5", (), asked[0]["id"]) and conv.messages[3] == Message("assistant", "it is 5")
    assert conv.prompt == 1 and conv.trained == {1, 3} and conv.tools == TOOLS
    assert trained_chat("") is None and trained_chat(AgentCalls((), (), None, 0).to_json()) is None
    # the rewritten call trained: the earlier answers are history it was sent (weight 0), its own answer trained
    later = trained_chat(tool_episode((2,))[0].to_json())
    assert [m.role for m in later.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert later.prompt == 5 and later.trained == {5} and later.tools is None

    sample = Sample(index=3, prompt_ids=np.array([1, 5]), response_ids=np.array([6, 7, 9, 8, 2]), gen_logprobs=np.zeros(5, np.float32),
                    id=40, group=40, loss_mask=np.array([1, 1, 0, 1, 1], np.int8), turn_lens=np.array([2, 1, 2, 0]), env_end=EnvEnd.DONE,
                    agent_calls=calls.to_json())
    chat = chat_of(sample, None)  # an agent's chat needs no decoder: its text is the calls'
    rows = chat.rows()
    assert [m["weight"] for m in rows] == [0, 1, 0, 1] and chat.prompt == 1 and json.loads(chat.tools) == TOOLS
    assert rows[1]["tool_calls"] == asked  # as OpenAI's API has them: {id, type, function: {name, arguments}}
    assert [list(m) for m in rows] == [["role", "content", "tool_calls", "tool_call_id", "weight"]] * 4  # every key: one Arrow struct
    assert rows[2] == {"role": "tool", "content": "5", "tool_calls": None, "tool_call_id": asked[0]["id"], "weight": 0}


def decode(ids, skip: bool) -> str:
    return "".join("<s>" if i == 1 and not skip else "" if i == 1 else chr(ord("a") + int(i)) for i in np.asarray(ids).tolist())


def episode(sid: int = 0, score: float = 0.0, group: int = 0, **kw) -> Sample:
    """Two turns: action [3, 4] then observation [7], action [5, 1] then observation [8, 9] (1 is <s>: an end)."""
    return Sample(index=2, prompt_ids=np.array([1, 2]), response_ids=np.array([3, 4, 7, 5, 1, 8, 9]),
                  gen_logprobs=np.array([-1, -2, 0, -3, -4, 0, 0], np.float32), id=sid, group=group, score=score,
                  loss_mask=np.array([1, 1, 0, 1, 1, 0, 0], np.int8), turn_lens=np.array([2, 1, 2, 2]), turn_rewards=np.array([0.0, 1.0]),
                  **{"env_end": EnvEnd.DONE, **kw})


def test_an_episode_is_a_chat_turn_by_turn_and_its_token_columns_mask_the_observations():
    chat = chat_of(episode(), decode)
    assert [(m["role"], m["content"], m["weight"]) for m in chat.rows()] == [
        ("user", "c", 0), ("assistant", "de", 1), ("user", "h", 0), ("assistant", "f", 1), ("user", "ij", 0)]
    spec, form = Spec(SFT, 1, 1, tokens=True), Form(True, False)
    row = sft_row(Item(episode(), 7, "ab" * 32, decode), "run", form, spec)
    assert row["input_ids"] == [1, 2, 3, 4, 7, 5, 1, 8, 9]
    assert row["labels"] == [IGNORE, IGNORE, 3, 4, IGNORE, 5, 1, IGNORE, IGNORE]
    assert row["gen_logprobs"] == [0, 0, -1, -2, 0, -3, -4, 0, 0]
    assert list(row) == form.columns(spec) and row["step"] == 7 and row["chain"] == "ab" * 32
    single = Sample(index=2, prompt_ids=np.array([1, 2]), response_ids=np.array([3, 1]), gen_logprobs=np.array([-1, -2], np.float32))
    text = sft_row(Item(single, 1, "", decode), "run", Form(False, False), Spec(SFT, 1, 1))
    assert (text["prompt"], text["completion"]) == ("c", "d")  # special tokens left out of the text (the ids keep them)


def items(*samples: Sample) -> list[Item]:
    return [Item(s, 1, "", decode) for s in samples]


def ids(chosen) -> list:
    return [it.sample.id for it in chosen]


def test_sft_rows_leave_out_faults_then_keep_scores_at_least_min_score_then_each_groups_best():
    group = items(episode(0, 1.0), episode(1, 3.0), episode(2, 3.0), episode(3, 9.0, env_reason="raised", env_end=EnvEnd.FAULT),
                  episode(4, 2.0, group=4), episode(5, float("nan"), group=4), episode(6, 5.0, group=4, fault="reward function raised"))
    counts = Counts()
    assert ids(choose_sft(group, Spec(SFT, 1, 1), counts)) == [0, 1, 2, 4, 5] and counts.faults == 2
    counts = Counts()
    assert ids(choose_sft(group, Spec(SFT, 1, 1, min_score=2.0), counts)) == [1, 2, 4] and counts.below_min_score == 2  # NaN is below
    counts = Counts()
    assert ids(choose_sft(group, Spec(SFT, 1, 1, best_of_group=True), counts)) == [1, 4]  # a tie: the first generated
    assert counts.not_best_of_group == 3
    assert not any("chat" in vars(it) for it in group)  # chosen by score alone: no sample's text made (a row makes its own)


def test_pairs_are_the_best_against_the_worst_of_one_prompt_never_equal_and_at_least_the_margin_apart():
    other = Sample(index=2, prompt_ids=np.array([1, 3]), response_ids=np.array([3]), gen_logprobs=np.zeros(1, np.float32), id=9, score=-5.0)
    group = items(episode(0, 1.0), episode(1, 3.0), episode(2, 0.5), episode(3, 9.0, fault="x"), other)
    pair = choose_pairs(group, Spec(DPO, 1, 1), Counts())
    assert [(c.sample.id, r.sample.id) for c, r in pair] == [(1, 2)]  # the fault is never chosen; another prompt never paired
    every = choose_pairs(group, Spec(DPO, 1, 1, all_pairs=True, margin=1.0), Counts())
    assert [(c.sample.id, r.sample.id) for c, r in every] == [(1, 0), (1, 2)]  # 1.0 over 0.5 is under the margin
    counts = Counts()
    assert choose_pairs(items(episode(0, 1.0), episode(1, 1.0)), Spec(DPO, 1, 1), counts) == [] and counts.no_pair == 1
    assert choose_pairs(group, Spec(DPO, 1, 1, min_score=5.0), Counts()) == []  # the chosen must reach it


@pytest.mark.parametrize("kw, says", [({"kind": DPO, "best_of_group": True}, "--best-of-group chooses SFT rows"),
                                      ({"kind": SFT, "all_pairs": True}, "pass them with --dpo"),
                                      ({"kind": DPO, "margin": -1.0}, "give 0 or more"),
                                      ({"kind": SFT, "min_score": float("nan")}, "give a finite number")])
def test_a_filter_that_means_nothing_is_one_sentence(kw, says):
    with pytest.raises(UsageError, match=says) as e:  # a wrong argument: exit 2
        Spec(first=1, last=2, **kw)
    assert e.value.exit_code == 2


# ----------------------------------------------------------------------------- on a real journal

def digits_run(path: Path, steps: int, per_step: int = 4) -> Path:
    """A run directory (its ledger's identity, the digits vocabulary) whose steps each add one group of samples."""
    with Journal.open_writer(path / "journal") as j:
        cfg = make_config(None, [f"rollout.n={per_step}"])
        Ledger(j).start({"config": cfg.to_stored(), "config_hash": cfg.hash(), "created": "2026-01-01T00:00:00Z", "world_size": 1})
        rng = np.random.default_rng(0)
        batch = []
        for step in range(1, steps + 1):
            g = (step - 1) * per_step
            group = [Sample(index=step % 97, prompt_ids=np.array([1, 5 + step % 9, 14, 6, 17]), response_ids=rng.integers(4, 19, 6),
                            gen_logprobs=rng.standard_normal(6).astype(np.float32), id=g + k, group=g, score=float(k % 3),
                            policy_version=step - 1) for k in range(per_step)]
            batch.append((step, [Added(np.arange(g, g + per_step), pack(group)).to_event(), make_event("metrics", values={"x": 1.0})]))
            if len(batch) == 500:
                j.writer.append_steps(batch)
                batch = []
        if batch:
            j.writer.append_steps(batch)
    return path


def flip_a_payload_byte(journal: Path, step: int, remove: bool = False) -> None:
    """Damage step `step`'s record in place (remove: take it out of the journal)."""
    import lmdb

    env = lmdb.open(str(journal), max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"steps", create=False)
        with env.begin(write=True) as txn:
            if remove:
                txn.delete(step_key(step), db=db)
                return
            raw = bytearray(txn.get(step_key(step), db=db))
            raw[-3] ^= 0xFF
            txn.put(step_key(step), bytes(raw), db=db)
    finally:
        env.close()


def test_chained_reads_each_step_with_its_chain_and_says_which_are_damaged_going_on(tmp_path):
    run = digits_run(tmp_path / "run", 5)
    with Journal.open_reader(run / "journal") as j:
        chains = [j.chain_hash(s) for s in range(1, 6)]
    flip_a_payload_byte(run / "journal", 3)
    with Journal.open_reader(run / "journal") as j:
        got = list(StepReader(j).chained(2, 5))
    assert [(g.step, g.chain) for g in got] == [(s, chains[s - 1]) for s in range(2, 6)]
    assert [g.problem for g in got] == [None, "its stored bytes do not match its checksum", None, None]
    assert got[1].record is None and [g.record.step for g in got if g.record is not None] == [2, 4, 5]
    flip_a_payload_byte(run / "journal", 4, remove=True)
    with Journal.open_reader(run / "journal") as j:
        got = list(StepReader(j).chained(1, 9))
    assert [(g.step, g.problem) for g in got] == [(1, None), (2, None), (3, "its stored bytes do not match its checksum"),
                                                  (4, "it is missing from the journal"), (5, "its record does not link to the previous record's hash")]


def test_an_export_leaves_a_damaged_step_out_and_says_so_and_verify_names_the_rows_it_cannot_check(tmp_path):
    run = digits_run(tmp_path / "run", 4)
    whole = export_dataset(run, tmp_path / "whole", SFT, "jsonl", None)
    flip_a_payload_byte(run / "journal", 2)
    part = export_dataset(run, tmp_path / "part", SFT, "jsonl", None)
    assert (whole.rows, part.rows) == (16, 12)
    assert part.notes == [f"warning: step 2 is damaged in the journal (its stored bytes do not match its checksum): its samples are left out; "
                          f"run `verlj verify {run}`"]
    assert read_manifest(tmp_path / "part").left_out.damaged == {2: "its stored bytes do not match its checksum"}
    assert {r["step"] for r in file_rows(tmp_path / "part" / "data/train-00000-of-00001.jsonl", "jsonl")} == {1, 3, 4}
    assert verify_export(tmp_path / "part", run).ok
    rep = verify_export(tmp_path / "whole", run)
    assert not rep.ok and rep.bad_rows == 4
    assert rep.problems[0] == ("row 5 of data/train-00000-of-00001.jsonl (step 2, sample 4): step 2 is damaged in the journal (its stored "
                               "bytes do not match its checksum): its rows cannot be checked")


def peak_traced(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_long_journal_exports_and_verifies_streamed_in_memory_that_does_not_grow_with_its_steps(tmp_path):
    """Four times the steps, the same peak of Python memory (pyarrow's pool and the journal's map aside: the rows are
    written a row group at a time, read back a row group at a time). A 100,000-step journal: docs/guides/datasets.md."""
    warm = digits_run(tmp_path / "warm", 2)
    export_dataset(warm, tmp_path / "warm-e", SFT, "parquet", None, tokens=True)  # the modules it imports are not what is measured
    verify_export(tmp_path / "warm-e", warm)
    peaks = {}
    for steps in (300, 1200):  # both past a batch of rows (distill_files.BATCH_ROWS)
        run = digits_run(tmp_path / f"r{steps}", steps)
        out = tmp_path / f"e{steps}"
        peaks[steps] = (peak_traced(lambda: export_dataset(run, out, SFT, "parquet", None, tokens=True)),
                        peak_traced(lambda: verify_export(out, run)))
        assert read_manifest(out).rows == 4 * steps
    (export_small, verify_small), (export_big, verify_big) = peaks[300], peaks[1200]
    assert export_big < 1.1 * export_small, peaks
    assert verify_big < 1.1 * verify_small, peaks
