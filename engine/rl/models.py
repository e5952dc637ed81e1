"""Models and tokenizers: the built-in tiny Llama, local Hugging Face directories, the value head.

Nothing here downloads: `model_name_or_path` is either ``builtin:tiny`` (a random-init Llama
built from :class:`~verlj.engine.config.TinyModelConfig` with a character tokenizer) or a local
directory loaded with ``local_files_only=True``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import Config, TinyModelConfig
from ..errors import DataError, ModelError
from .vocab import builtin_chars, builtin_vocab

BUILTIN_TINY = "builtin:tiny"


# ----------------------------------------------------------------------------- tokenizers


def builtin_tokenizer(chars: list[str]):
    """A character-level PreTrainedTokenizerFast over `chars` (saveable, so exports are real HF directories)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = builtin_vocab(chars)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


# The built-in tokenizer's chat template: each message as "<|ROLE|>\nCONTENT\n", then the generation
# prompt "<|assistant|>\n" (the model answers after it). The trainer prepends <bos> as to any prompt.
BUILTIN_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
BUILTIN_GENERATION_PROMPT = "<|assistant|>\n"


def render_chat(tok, messages: list[dict], builtin: bool, generation_prompt: bool = True) -> str:
    """A chat prompt's text: the built-in template (`builtin`), else the tokenizer's own
    (`apply_chat_template`, with the generation prompt unless `generation_prompt` is False). DataError if it has
    none or it fails."""
    if builtin:
        return "".join(BUILTIN_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + (
            BUILTIN_GENERATION_PROMPT if generation_prompt else "")
    if not getattr(tok, "chat_template", None):
        raise DataError("its prompt is a list of chat messages but the model's tokenizer has no chat template")
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - the tokenizer's template (jinja) failing on these messages
        raise DataError(f"the tokenizer's chat template failed on its messages ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def chat_template(tok, builtin: bool) -> Callable[[list, list | None, bool], str]:
    """The agent gateway's template: (messages, tools, generation_prompt) -> text. The tokenizer's own chat template
    with its tools; the built-in model's (which has no tool syntax) with the tools leading as a system message."""
    if builtin:
        def builtin_text(messages: list, tools: list | None, generation_prompt: bool) -> str:
            lead = [{"role": "system", "content": "Tools: " + json.dumps(tools, ensure_ascii=False)}] if tools else []
            return render_chat(tok, lead + messages, True, generation_prompt)

        return builtin_text

    def own(messages: list, tools: list | None, generation_prompt: bool) -> str:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    return own


def _local_dir(path: str, key: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(f"{key}: model directory {path} does not exist (verlj loads local directories only, never downloads)")
    return p


def tiny_chars(cfg: Config) -> list[str]:
    """The built-in model's characters for this run (model.tiny.vocab)."""
    return builtin_chars(cfg.model.tiny.vocab, cfg.data.train_dataset)


def load_tokenizer(path: str, key: str = "model.actor.model_name_or_path", cfg: Config | None = None):
    """A local directory's tokenizer, or the built-in model's (its vocabulary from `cfg`)."""
    if path == BUILTIN_TINY:
        assert cfg is not None, "the built-in model's tokenizer needs the run's config (model.tiny.vocab)"
        return builtin_tokenizer(tiny_chars(cfg))
    from transformers import AutoTokenizer

    local = _local_dir(path, key)  # its own sentence, already naming the key
    try:
        tok = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"{key}: cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelError(f"{key}: the tokenizer in {path} has no eos token")
    return tok


# ----------------------------------------------------------------------------- models


def tiny_llama_config(tiny: TinyModelConfig, vocab_size: int, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def load_causal_lm(path: str, cfg: Config, seed: int, key: str = "model.actor.model_name_or_path") -> nn.Module:
    """The actor (and reference) model: random-init tiny Llama from `seed`, or a local HF directory."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if path == BUILTIN_TINY:
        max_pos = cfg.data.max_prompt_length + cfg.rollout.max_response_length + 8
        config = tiny_llama_config(cfg.model.tiny, len(tiny_chars(cfg)) + 4, max_pos)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    else:
        local = _local_dir(path, key)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(local), local_files_only=True, torch_dtype=torch.float32, attn_implementation="eager"
            )
        except (OSError, ValueError) as e:
            raise ModelError(f"{key}: cannot load a causal LM from {path}: {str(e).splitlines()[0]}") from None
    model.config.use_cache = False
    return model


def load_reward_model(path: str):
    """A frozen sequence-classification reward model and its tokenizer, from a local dir. A directory
    without a trained classification head (e.g. a causal LM) is refused: transformers would add a
    random one, and the rewards would mean nothing."""
    from transformers import AutoModelForSequenceClassification

    key = "model.reward_model.model_name_or_path"
    local = _local_dir(path, key)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(local), local_files_only=True, torch_dtype=torch.float32, output_loading_info=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{key}: cannot load a sequence-classification model from {path}: {str(e).splitlines()[0]}") from None
    if missing := sorted(info.get("missing_keys") or []):
        raise ModelError(
            f"{key}: {path} is not a sequence-classification model (its weights lack {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); a reward model needs a trained score head"
        )
    tok = load_tokenizer(path, key)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, tok


def model_digest(path: str) -> str:
    """BLAKE3 over a model directory's files (names and contents): the identity of a frozen model."""
    import blake3

    from ..state.manifest import file_digest

    root = Path(path)
    h = blake3.blake3()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(f"{p.relative_to(root).as_posix()}={file_digest(p)}\n".encode())
    return h.hexdigest()


class ValueModel(nn.Module):
    """PPO critic: a causal-LM backbone with a scalar value head on the last hidden state."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return self.value_head(out.hidden_states[-1]).squeeze(-1)


# ----------------------------------------------------------------------------- transformers 4 / 5


def _cache_kw(model: nn.Module) -> str:
    if hasattr(model, "get_base_model"):  # peft's wrapper (LoRA) passes the keyword on to the model it wraps
        model = model.get_base_model()
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_with_cache(model: nn.Module, input_ids, attention_mask, position_ids, cache):
    """One decoding forward with a KV cache; returns (logits, cache). transformers 5 calls it `cache`."""
    kw = _cache_kw(model)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **{kw: cache}
    )
    new_cache = out.cache if kw == "cache" else out.past_key_values
    return out.logits, new_cache
