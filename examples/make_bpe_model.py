"""A small model with a real tokenizer, made here with no download: a Qwen2 whose tokenizer is a byte-level BPE
trained by `tokenizers` on text generated below, with a ChatML chat template that speaks tools (hermes-style
``<tool_call>``) and ``<|im_end|>`` as its end of sequence, as Qwen2.5's does. Its weights are a random init
warmed up for 300 steps on ChatML conversations (about 30 s on one core), so that it answers briefly
and ends its turn with ``<|im_end|>`` as a chat model does, and sometimes writes a tool call; it knows nothing
else.

    python examples/make_bpe_model.py models/bpe                 # then model.actor.model_name_or_path=models/bpe
    verlj train -o runs/bpe-agent --config examples/agent.yaml model.actor.model_name_or_path=models/bpe

The built-in model's character vocabulary turns any text into the same ids and back; a byte-level BPE does not:
a sampled sequence is often not the tokenizer's own split of its text (``hel`` + ``lo`` for ``hello``, a
character cut between two tokens), so text tokenized again gives other ids. This model is what verlj's tests of
the agent gateway, environments, chat data and vLLM run on beside the built-in one (tests/conftest.py: the
``bpe_model`` fixture), and what a user can try a real tokenizer with offline. The same arguments make the same
directory, byte for byte (the corpus, the merges and the weights all come from `seed`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: skipped when decoding with skip_special_tokens
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]  # kept in decoded text

# ChatML with tools, in the shape of Qwen2.5's template: the tools listed in the system turn, an assistant's tool
# calls written as hermes <tool_call> JSON, tool results in a user turn as <tool_response> blocks. An assistant's turn
# is marked {% generation %} (its text and <|im_end|>: what the model writes), as TRL's SFTTrainer(assistant_only_loss=
# True) needs to train the assistant's tokens alone (return_assistant_tokens_mask); the marks write nothing.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- generation %}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}{{- (message.content or '') + '<|im_end|>' }}{%- endgeneration %}
{{- '\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WORDS = ("the a an of to in is it that for on with as was by this be are from at or not you we they he she his her "
         "answer question number sum add plus equals result tool call function arguments value think first then so "
         "model user assistant system reply count down step next done wrong right true false error output input "
         "what which how many two three four five six seven eight nine ten zero one hundred total please compute "
         "the calculator returns gives check again let me see because therefore hello world good well here there "
         "word letter digit line text json name type object integer string list key run train sample reward").split()
UNICODE = ["café", "naïve", "über", "niño", "Straße", "你好", "世界", "数字", "答案", "ありがとう", "привет", "😀", "🚀", "→", "±", "½", "€"]


def corpus(seed: int, lines: int = 6000) -> str:
    """Text to learn merges from: English-like sentences, sums, chat and tool-call JSON, some non-ASCII
    (several-byte characters, so that a sampled token can end inside one)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.35:
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
            if rng.random() < 0.2:
                words.insert(rng.randrange(len(words)), rng.choice(UNICODE))
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
        elif kind < 0.6:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(rng.choice([f"{a}+{b}={a + b}", f"What is {a} plus {b}? {a + b}", f"{a} + {b} = {a + b}", f"{a}+{b}="]))
        elif kind < 0.8:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append(json.dumps({"name": rng.choice(["add", "multiply", "lookup", "count"]), "arguments": {"a": a, "b": b}}))
        else:
            out.append(json.dumps({"type": "function", "function": {"name": rng.choice(["add", "search"]), "description": "a + b",
                                   "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}))
    return "\n".join(out)


def make_tokenizer(seed: int = 0, vocab_size: int = 3000):
    """The byte-level BPE (a few thousand merges over `corpus(seed)`), as a transformers tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(corpus(seed).splitlines(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:], chat_template=CHAT_TEMPLATE)
    tok.add_tokens(ADDED)  # not special: decoding keeps them, so a tool call's tags reach the parser
    return tok


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
# the same tool as an agent library describes it (the OpenAI Agents SDK's strict JSON schema of a @function_tool)
STRICT = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "properties": {"a": {"description": "the first addend.", "title": "A", "type": "integer"},
                   "b": {"description": "the second addend.", "title": "B", "type": "integer"}},
    "required": ["a", "b"], "title": "add_args", "type": "object", "additionalProperties": False}, "strict": True}}]


def conversations(tok, seed: int, n: int, tools: bool) -> list[str]:
    """ChatML conversations to warm the model up on: a question and a short answer; with `tools`, the add tool
    offered and called (hermes JSON), then the tool's result and the answer."""
    rng = random.Random(seed + 1 + tools)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        user = {"role": "user", "content": rng.choice([f"{a}+{b}=", f"What is {a} plus {b}?", " ".join(rng.choice(WORDS) for _ in range(5))])}
        if tools:
            call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}
            system = rng.choice([[], [{"role": "system", "content": "Answer with the number. Use the add tool to add."}],
                                 [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(6))}]])
            msgs = [*system, user, call, {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
            out.append(tok.apply_chat_template(msgs, tools=rng.choice([TOOLS, STRICT]), tokenize=False))
        else:
            answer = str(a + b) if "+" in user["content"] or "plus" in user["content"] else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
            out.append(tok.apply_chat_template([user, {"role": "assistant", "content": answer}], tokenize=False))
    return out


def warm_up(model, tok, seed: int, steps: int) -> None:
    """`steps` AdamW steps of next-token loss on `conversations`, every other one on a batch of 8 with the tool, the others
    on 16 without (a batch is padded to its longest: the tool's system turn is long); deterministic (one thread, fixed
    order)."""
    import torch

    plain, tool = conversations(tok, seed, 16 * steps, False), conversations(tok, seed, 8 * steps, True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for k in range(steps):
            batch = tool[8 * k : 8 * k + 8] if k % 2 else plain[16 * k : 16 * k + 16]
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
            loss = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)


def make_bpe_model(out: str | Path, seed: int = 0, hidden_size: int = 64, layers: int = 2, vocab_size: int = 3000,
                   warmup_steps: int = 300) -> Path:
    """Write the tokenizer and the Qwen2 (head size 32, which vLLM's CPU attention runs; random init, then
    `warmup_steps` on ChatML conversations) to `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    tok = make_tokenizer(seed, vocab_size)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                         num_attention_heads=hidden_size // 32, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        warm_up(model, tok, seed, warmup_steps)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the directory to write (model.actor.model_name_or_path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=3000)
    ap.add_argument("--warmup-steps", type=int, default=300, help="steps on ChatML conversations after the random init (0: none)")
    args = ap.parse_args()
    path = make_bpe_model(args.out, args.seed, vocab_size=args.vocab_size, warmup_steps=args.warmup_steps)
    print(f"wrote {path}: a Qwen2 with a byte-level BPE of {args.vocab_size} tokens and a ChatML template "
          f"({args.warmup_steps} warm-up steps)")


if __name__ == "__main__":
    main()
