"""Calls spliced on a real tokenizer (gateway.prompts): a byte-level BPE with a ChatML template (the bpe_model
fixture's tokenizer, examples/make_bpe_model.py), a policy whose completions are not the tokenizer's own split of their text
(``h``+``e``+``llo``, a character cut between two tokens), and openai-client agents that send their history back as
answered. Rendered whole, most continuing calls would break the sequence; spliced, none does, with and without
tools, in parallel, across a template that drops earlier reasoning; only a real rewrite starts a segment. The
bpe_model shipped with the tests is the recipe's (tests/fixtures/bpe_model)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest

from verlj.engine.rl.gateway import token_ledger as ledger
from verlj.engine.rl.gateway.prompts import Prompts
from verlj.engine.rl.gateway.runner import Episodes, Runner, Settings
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.models import chat_template

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(bpe_tokenizer):
    return bpe_tokenizer


def test_the_shipped_bpe_model_is_the_recipe_s_with_its_tokenizer(tok, tmp_path):
    """The bpe_model fixture copies tests/fixtures/bpe_model while the recipe that made it is unchanged: its stamp
    is examples/make_bpe_model.py's SHA-256, its tokenizer is byte for byte what the recipe trains now, and its
    weights load into the Qwen2 its config describes, every tensor there, the embedding the vocabulary's size."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2ForCausalLM

    from verlj_testing import SHIPPED_BPE, SHIPPED_BPE_REMAKE, bpe_recipe

    stamp = (SHIPPED_BPE / "recipe.sha256").read_text().strip()
    assert stamp == bpe_recipe(), f"examples/make_bpe_model.py changed since tests/fixtures/bpe_model was made: {SHIPPED_BPE_REMAKE}"
    tok.save_pretrained(tmp_path)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (SHIPPED_BPE / name).read_bytes(), name
    made, shipped = (json.loads((d / "tokenizer.json").read_text()) for d in (tmp_path, SHIPPED_BPE))
    for state in ("truncation", "padding"):  # what the warm-up's batches left set on it, not the tokenizer
        made.pop(state), shipped.pop(state)
    assert made == shipped  # the vocabulary, merges, added tokens, pre-tokenizer and decoder
    config = AutoConfig.from_pretrained(SHIPPED_BPE, local_files_only=True)
    weights = load_file(str(SHIPPED_BPE / "model.safetensors"))
    expected = {n: tuple(t.shape) for n, t in Qwen2ForCausalLM(config).state_dict().items() if n != "lm_head.weight"}  # tied
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected
    assert config.vocab_size == len(tok) and weights["model.embed_tokens.weight"].shape[0] == len(tok)


def pieces(tok, text: str) -> list[int]:
    """`text` as the policy might sample it: a token a character where the vocabulary has one (several bytes'
    characters as their byte tokens), never the tokenizer's own merges."""
    out = []
    for ch in text:
        single = tok(ch, add_special_tokens=False).input_ids
        out += single if len(single) == 1 else tok.convert_tokens_to_ids(list(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(ch)[0][0]))
    return out


class Policy:
    """Scripted: call k of an episode answers `answers[k]` (text, or a tool call), spelt with `pieces`, then
    <|im_end|> (or cut at `max_tokens` without it)."""

    streams = False

    def __init__(self, tok, answers: list[str], end: bool = True):
        self.tok, self.answers, self.end, self.batches = tok, answers, end, []

    def __call__(self, prompts, seeds, episodes, on_token=None):
        self.batches.append(len(prompts))
        outs = [np.asarray(pieces(self.tok, self.answers[s % 100]) + ([self.tok.eos_token_id] if self.end else []), np.int64) for s in seeds]
        return outs, [np.full(len(o), -0.25, np.float32) for o in outs]


def play(tok, agent, answers: list[str], prompts_cls=Prompts, template=None, n: int = 2, end: bool = True, max_turns: int = 4):
    gw = Gateway("m").start()
    try:
        r = Runner(gw, agent, prompts_cls(tok, template or chat_template(tok, False)), Policy(tok, answers, end), Settings(n, 10.0, max_turns))
        out = r.play(Episodes([{"prompt": f"What is {i} plus 3?"} for i in range(n)], list(range(n)), list(range(n)),
                              lambda place, k: 100 * place + k))
    finally:
        gw.stop()
    assert [p.fault for p in out] == [""] * n
    return out


def echo(calls: int, tools: list | None = None, **extra):
    """An openai-client agent that sends back each answer as it came, then a tool's result or a next question."""
    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        for k in range(calls):
            m = client.chat.completions.create(model=ep.model, messages=msgs, **({"tools": tools} if tools else {}), **extra).choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            msgs += ([{"role": "tool", "tool_call_id": c.id, "content": "7"} for c in m.tool_calls] if m.tool_calls
                     else [{"role": "user", "content": f"and café {k}?"}])
        return 1.0
    return agent


class Whole(Prompts):
    """The gateway before splicing: every conversation rendered by the template and tokenized whole."""

    def ids(self, messages, tools, earlier, forced=""):
        return self.whole(messages, tools, forced)


def test_a_conversation_sent_back_as_answered_is_spliced_where_tokenizing_it_again_breaks(tok):
    answers = ["hello world", "café 42", "12 plus 3"]
    spliced = play(tok, echo(3), answers)
    again = play(tok, echo(3), answers, Whole)
    for p in spliced:
        chain, segments = ledger.trained_chain(p.calls)
        assert (chain, segments) == ((0, 1, 2), 1)
        for a, b in zip(p.calls, p.calls[1:]):  # each prompt: the previous prompt and completion as generated, then more
            head = np.concatenate([a.prompt_ids, a.completion_ids])
            assert b.prompt_ids[: len(head)].tolist() == head.tolist()
            # what comes between: the template's end of turn (its <|im_end|> sampled already) and the new message
            assert tok.decode(b.prompt_ids[len(head):]).startswith("\n<|im_start|>user\nand café")
    assert all(ledger.trained_chain(p.calls)[1] == 3 for p in again)  # tokenized again, every continuing call breaks
    # the same conversation either way: the answers' text and the requests are the same, only the ids differ
    assert [[c.request for c in p.calls] for p in spliced] == [[c.request for c in p.calls] for p in again]


def test_a_completion_cut_short_gets_the_end_of_turn_the_template_writes(tok):
    out = play(tok, echo(2), ["hello world", "café"], end=False)
    a, b = out[0].calls
    assert a.completion_ids[-1] != tok.eos_token_id
    between = tok.decode(b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids):])
    assert between.startswith("<|im_end|>\n<|im_start|>user\n") and ledger.trained_chain(out[0].calls)[1] == 1
    f = ledger.sample_fields(out[0].calls, (0, 1))
    n = len(a.completion_ids)
    assert f["loss_mask"][:n].tolist() == [1] * n and f["loss_mask"][n] == 0  # the end of turn is the template's: masked


def test_tool_calls_and_their_results_splice_and_the_tool_turn_is_masked(tok):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    out = play(tok, echo(3, TOOLS), [call, "7", "café"])
    for p in out:
        assert ledger.trained_chain(p.calls) == ((0, 1, 2), 1)
        first = json.loads(p.calls[0].response)["choices"][0]
        assert first["finish_reason"] == "tool_calls" and first["message"]["tool_calls"][0]["function"]["name"] == "add"
        second = json.loads(p.calls[1].request)["messages"]
        assert second[-2]["tool_calls"][0]["id"] == first["message"]["tool_calls"][0]["id"] and second[-1]["role"] == "tool"
        a, b = p.calls[:2]
        obs = tok.decode(b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids):])
        assert obs.startswith("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        f = ledger.sample_fields(p.calls, (0, 1, 2))
        assert f["turn_lens"][1] == len(b.prompt_ids) - len(a.prompt_ids) - len(a.completion_ids)
        assert f["gen_logprobs"][f["loss_mask"] == 1].tolist() == [-0.25] * int(f["loss_mask"].sum())


def test_tool_calls_sent_back_under_ids_of_the_agents_own_still_splice(tok):
    """A call's id is never rendered into tokens: an agent (a framework) that gives the calls it was answered ids of its
    own, and answers them by those, sends back the tokens it was answered; it is spliced, every call."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'

    def renamer(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        for k in range(3):
            m = client.chat.completions.create(model=ep.model, messages=msgs, tools=TOOLS).choices[0].message.model_dump(exclude_none=True)
            for j, c in enumerate(m.get("tool_calls", [])):
                c["id"] = f"mine_{k}_{j}"
            msgs.append(m)
            msgs += ([{"role": "tool", "tool_call_id": c["id"], "content": "7"} for c in m["tool_calls"]] if m.get("tool_calls")
                     else [{"role": "user", "content": "and?"}])
        return 1.0

    out = play(tok, renamer, [call, call, "7"])
    for p in out:
        assert ledger.trained_chain(p.calls) == ((0, 1, 2), 1)
        assert [m["tool_calls"][0]["id"] for m in json.loads(p.calls[2].request)["messages"] if m.get("tool_calls")] == ["mine_0_0", "mine_1_0"]


def test_a_tool_calls_id_decides_no_rendering_and_its_name_and_arguments_do(tok):
    """Why a splice may compare tool calls by name and arguments only: two histories that differ in ids alone render
    the same text (so the same ids), and any other difference in a call is no longer the answer."""
    from verlj.engine.rl.gateway.protocol import same_answer, same_history

    prompts = Prompts(tok, chat_template(tok, False))
    answer = {"content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    sent = {"role": "assistant", **answer}
    renamed = {**sent, "tool_calls": [{**answer["tool_calls"][0], "id": "other"}]}
    history = [{"role": "user", "content": "x"}, sent, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    again = [history[0], renamed, history[2]]
    assert prompts.render(history, TOOLS) == prompts.render(again, TOOLS) and "call_1" not in prompts.render(history, TOOLS)
    assert same_answer(renamed, answer) and same_history(history, again)
    for change in ({"name": "mul"}, {"arguments": '{"a": 2}'}):
        other = {**sent, "tool_calls": [{**answer["tool_calls"][0], "function": {**answer["tool_calls"][0]["function"], **change}}]}
        assert not same_answer(other, answer) and not same_history(history, [history[0], other, history[2]])
    assert not same_answer({**sent, "content": "y"}, answer)
    assert not same_history(history, [history[0], sent, {**history[2], "tool_call_id": "other"}])  # a template may write that one


def test_an_edited_answer_is_a_real_rewrite_and_starts_a_segment(tok):
    def editor(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        got = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content
        msgs += [{"role": "assistant", "content": got.upper()}, {"role": "user", "content": "sure?"}]  # not what it answered
        client.chat.completions.create(model=ep.model, messages=msgs)
        return 1.0

    out = play(tok, editor, ["hello world", "yes"])
    assert all(ledger.parents(p.calls) == [-1, -1] and ledger.trained_chain(p.calls)[1] == 2 for p in out)


def test_calls_in_parallel_from_one_point_are_each_spliced_onto_it(tok):
    async def fork(ep):
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        m = (await client.chat.completions.create(model=ep.model, messages=msgs)).choices[0].message
        msgs.append({"role": "assistant", "content": m.content})
        await asyncio.gather(*(client.chat.completions.create(model=ep.model, messages=[*msgs, {"role": "user", "content": q}])
                               for q in ("left", "right")))
        return 1.0

    out = play(tok, fork, ["hello world", "café", "42"])
    for p in out:
        assert ledger.parents(p.calls) == [-1, 0, 0]  # both continue call 0: a branch, no break
        assert ledger.trained_chain(p.calls)[1] == 1 and len(ledger.trained_chain(p.calls)[0]) == 2


# Qwen3's way with reasoning: an assistant turn before the last user message loses its <think> block
DROPS_THINKING = """{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}{%- set c = m.content or '' %}
{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_a_template_that_drops_earlier_reasoning_keeps_the_tokens_the_policy_produced(tok):
    from jinja2 import Template

    tmpl = Template(DROPS_THINKING)
    render = lambda messages, tools, gen: tmpl.render(messages=messages, add_generation_prompt=gen)  # noqa: E731
    out = play(tok, echo(2), ["<think>\nadd them\n</think>\n7", "ok"], template=render)
    for p in out:
        a, b = p.calls
        assert ledger.trained_chain(p.calls) == ((0, 1), 1)
        assert "<think>" in tok.decode(b.prompt_ids)  # the reasoning the policy produced stays in the sequence
        assert "<think>" not in render(json.loads(b.request)["messages"], None, True)  # the template's own rendering drops it
        assert tok.decode(b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids):]).startswith("\n<|im_start|>user\nand café 0?")


def test_a_call_past_the_context_is_refused_even_spliced(tok):
    seen = {}

    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        got = client.chat.completions.create(model=ep.model, messages=msgs).choices[0].message.content
        try:
            client.chat.completions.create(model=ep.model, messages=[*msgs, {"role": "assistant", "content": got},
                                                                     {"role": "user", "content": "more " * 40}])
        except openai.BadRequestError as e:
            seen[ep.episode] = e.code
        return 1.0

    gw = Gateway("m").start()
    try:
        r = Runner(gw, agent, Prompts(tok, chat_template(tok, False), max_prompt=40), Policy(tok, ["hi"]), Settings(1, 10.0, 3))
        out = r.play(Episodes([{"prompt": "x"}], [0], [5], lambda place, k: k))
    finally:
        gw.stop()
    assert out[0].fault == "" and seen == {5: "context_length_exceeded"} and len(out[0].calls) == 1


ADD = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def add_call(text: str) -> bool:
    """Whether `text` is a call of the add tool: a JSON object of its name and an object of arguments."""
    try:
        d = json.loads(text)
    except ValueError:
        return False
    return isinstance(d, dict) and set(d) == {"name", "arguments"} and d["name"] == "add" and isinstance(d["arguments"], dict)


def forced_then_result(ep):
    """tool_choice "required" (even episodes) or the add function named (odd ones); a call parsed is run, its result sent back."""
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": ep.row["prompt"]}]
    choice = "required" if ep.episode % 2 == 0 else {"type": "function", "function": {"name": "add"}}
    m = client.chat.completions.create(model=ep.model, messages=msgs, tools=ADD, tool_choice=choice).choices[0].message
    if m.tool_calls:
        args = json.loads(m.tool_calls[0].function.arguments)
        msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": str(args)}]
        client.chat.completions.create(model=ep.model, messages=msgs, tools=ADD)
    return 1.0


def test_forced_tool_calls_of_the_bpe_model_end_at_their_json_and_the_call_after_is_spliced(tok, bpe_model):
    """The BPE model through the gateway, its calls sampled by verlj's own sampler: 32 calls with tool_choice "required"
    and 32 with the function named. At least 90% of each are tool calls, every one journaled through the token that
    closed its JSON (the policy's, in the loss), none past it; each call that sends the tool's result back is spliced
    onto it (no prefix break), the closing tag the answer showed an observation token; and the same calls answered
    again are the same bytes. At rollout.temperature 0.5: the hotter this 300-step toy samples, the more often it writes
    a broken JSON value into the call (`"a": plus 13`, an object nested in `b` that never closes), which no ending can
    mend (at 1.0, 182 of 256 calls "required" and 204 of 256 named were tool calls; at 0.7, 249 and 247)."""
    import torch

    from verlj.engine.config import make_config
    from verlj.engine.rl.gateway.protocol import TOOL_OPEN, object_end
    from verlj.engine.rl.models import load_causal_lm
    from verlj.engine.rl.sampler import sample_seeded, sampling_params

    cfg = make_config(None, [f"model.actor.model_name_or_path={bpe_model}", "rollout.max_response_length=48", "rollout.temperature=0.5"])
    model = load_causal_lm(bpe_model, cfg, 0).eval()

    class Sampler:
        streams = False

        def __call__(self, prompts, seeds, episodes, on_token=None):
            with torch.no_grad():
                return sample_seeded(model, prompts, seeds, sampling_params(cfg), tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))

    def run():
        gw = Gateway("m").start()
        try:
            r = Runner(gw, forced_then_result, Prompts(tok, chat_template(tok, False)), Sampler(), Settings(64, 60.0, 2))
            rows = [{"prompt": f"{(7 * i) % 100}+{(13 * i + 5) % 100}="} for i in range(64)]
            return r.play(Episodes(rows, list(range(64)), list(range(64)), lambda place, k: 7919 * place + k)), r.counts
        finally:
            gw.stop()

    out, counts = run()
    assert [p.fault for p in out] == [""] * 64
    called = [len(p.calls) == 2 for p in out]
    assert sum(called[0::2]) >= 29 and sum(called[1::2]) >= 29, (sum(called[0::2]), sum(called[1::2]))  # required, named: >= 90% of 32
    assert [bool(p.calls[0].flag) for p in out] == [not c for c in called]  # a forced call that is no tool call: flagged
    assert counts.malformed_tool_calls == sum(bool(c.flag) for p in out for c in p.calls)
    for p in out:
        first = p.calls[0]
        forced = tok.decode(first.prompt_ids)[tok.decode(first.prompt_ids).rindex(TOOL_OPEN):]
        head, ids = forced[len(TOOL_OPEN):], first.completion_ids
        if len(p.calls) == 2:  # ended by the token that closed its JSON, and no token after it
            assert json.loads(first.response)["choices"][0]["finish_reason"] == "tool_calls"
            assert object_end(head + tok.decode(ids[:-1], skip_special_tokens=True)) < 0 <= object_end(head + tok.decode(ids))
            assert ledger.trained_chain(p.calls) == ((0, 1), 1)
            a, b = p.calls
            between = b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids):]
            assert tok.decode(between).startswith("\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n")
            f = ledger.sample_fields(p.calls, (0, 1))
            assert f["loss_mask"].tolist() == [1] * len(a.completion_ids) + [0] * len(between) + [1] * len(b.completion_ids)
        else:  # no call of the add tool was lost: what the policy wrote never closed, or is not one
            text = head + tok.decode(ids, skip_special_tokens=True)
            end = object_end(text)
            assert end < 0 or not add_call(text[:end]), text
    again, _ = run()
    assert [[c.response for c in p.calls] for p in again] == [[c.response for c in p.calls] for p in out]
    assert all(np.array_equal(x.completion_ids, y.completion_ids) for p, q in zip(out, again) for x, y in zip(p.calls, q.calls))
