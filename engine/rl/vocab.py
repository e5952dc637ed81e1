"""The built-in tiny model's character vocabulary, and decoding token ids to text without torch
(post-mortem commands decode journaled samples; they should not load a deep-learning stack)."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
BUILTIN_CHARS = list("0123456789+-*= ")  # the built-in arithmetic task needs no more


def builtin_vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIALS + BUILTIN_CHARS)}


class TextDecoder:
    """decode(ids, skip_special_tokens=True) for the built-in vocabulary or a tokenizer.json."""

    def __init__(self, model_path: str):
        self._tok = None
        self._chars = None
        if model_path == "builtin:tiny":
            self._chars = SPECIALS + BUILTIN_CHARS
        else:
            from tokenizers import Tokenizer  # fast tokenizers' own package: no torch

            self._tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return "".join(
            self._chars[i] for i in ids if 0 <= i < len(self._chars) and not (skip_special_tokens and i < len(SPECIALS))
        )
