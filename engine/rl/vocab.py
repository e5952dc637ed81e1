"""The built-in tiny model's character vocabularies, and decoding token ids to text without torch
(post-mortem commands decode journaled samples; they should not load a deep-learning stack).

``model.tiny.vocab`` chooses: ``digits`` (what the built-in arithmetic task needs), ``ascii``
(printable ASCII and newline: any text task) or ``auto`` (digits for ``builtin:add``, ascii for any
other dataset). A run stored before the key existed is a digits run (config.LEGACY_VALUES).
"""

from __future__ import annotations

from pathlib import Path

from ..config import config_from_stored

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCABS = {
    "digits": list("0123456789+-*= "),
    "ascii": [chr(c) for c in range(32, 127)] + ["\n"],
}


def builtin_chars(vocab: str, train_dataset: str) -> list[str]:
    """The characters of the built-in model's vocabulary (after the specials)."""
    if vocab == "auto":
        vocab = "digits" if train_dataset == "builtin:add" else "ascii"
    return VOCABS[vocab]


def builtin_vocab(chars: list[str]) -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIALS + chars)}


class TextDecoder:
    """decode(ids, skip_special_tokens=True) for a built-in vocabulary (`chars`) or a tokenizer.json."""

    def __init__(self, model_path: str, chars: list[str] | None = None):
        self._tok = None
        self._chars: list[str] = []  # the built-in vocabulary (its specials first); [] for a tokenizer.json
        if model_path == "builtin:tiny":
            self._chars = SPECIALS + (chars or VOCABS["digits"])
        else:
            from tokenizers import Tokenizer  # fast tokenizers' own package: no torch

            self._tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return "".join(
            self._chars[i] for i in ids if 0 <= i < len(self._chars) and not (skip_special_tokens and i < len(SPECIALS))
        )


def text_decoder(config: dict | None) -> TextDecoder | None:
    """The run's decoder (built-in vocabulary or tokenizer.json), or None when it cannot be found."""
    cfg = config_from_stored(config, unknown="none")
    if cfg is None:
        return None
    path = cfg.model.actor.model_name_or_path
    chars = builtin_chars(cfg.model.tiny.vocab, cfg.data.train_dataset or "")
    try:
        return TextDecoder(path, chars) if path else None
    except Exception:  # noqa: BLE001 - no tokenizer.json (model dir moved): show token ids instead
        return None
