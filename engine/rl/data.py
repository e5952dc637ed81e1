"""Prompts with ground truth, and the deterministic sampler.

Datasets: ``builtin:add`` (generated single-digit addition, a verifiable answer), or a JSONL /
Parquet file whose rows hold ``data.prompt_key`` and ``data.answer_key``.

Sampler: epoch e visits the dataset in the order ``permutation(seed, e)``; a cursor says how far
into that order the run is. Its whole state is (epoch, cursor): no hidden RNG.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DataConfig
from ..errors import DataError
from ..state.seeding import derive_seed
from ..state.stateful import check_version

BUILTIN_ADD = "builtin:add"


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def load_dataset(cfg: DataConfig, seed: int) -> list[Example]:
    if cfg.train_dataset == BUILTIN_ADD:
        rng = np.random.default_rng(derive_seed(seed, 0, "dataset"))
        ab = rng.integers(0, cfg.max_operand + 1, size=(cfg.num_examples, 2))
        return [Example(f"{a}+{b}=", str(a + b)) for a, b in ab.tolist()]
    path = Path(cfg.train_dataset)
    if not path.is_file():
        raise DataError(f"data.train_dataset: {path} does not exist (use builtin:add or a .jsonl/.parquet file)")
    if path.suffix == ".jsonl" or path.suffix == ".json":
        rows = []
        with path.open("rb") as f:
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"data.train_dataset: line {i} of {path} is not UTF-8 text") from None
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise DataError(f"data.train_dataset: line {i} of {path} is not valid JSON") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("data.train_dataset: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged or foreign file
            raise DataError(f"data.train_dataset: {path} is not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
    else:
        raise DataError(f"data.train_dataset: {path} must end in .jsonl or .parquet")
    if not rows:
        raise DataError(f"data.train_dataset: {path} holds no rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or cfg.prompt_key not in row or cfg.answer_key not in row:
            raise DataError(
                f"data.train_dataset: row {i} of {path} lacks the fields {cfg.prompt_key!r} and {cfg.answer_key!r} "
                "(set data.prompt_key / data.answer_key to the names your file uses)"
            )
        out.append(Example(str(row[cfg.prompt_key]), str(row[cfg.answer_key])))
    return out


class Sampler:
    """Per-epoch permutation from the seed, with a cursor. Stateful: state_dict / load_state_dict."""

    VERSION = 1

    def __init__(self, size: int, seed: int):
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(derive_seed(self.seed, epoch, "sampler")).permutation(self.size)

    def draw(self, k: int) -> np.ndarray:
        """The next k dataset indices, crossing epoch boundaries as needed."""
        out = []
        while k > 0:
            if self.cursor == self.size:
                self.epoch += 1
                self.cursor = 0
                self._perm = self._permutation(self.epoch)
            take = min(k, self.size - self.cursor)
            out.append(self._perm[self.cursor : self.cursor + take])
            self.cursor += take
            k -= take
        return np.concatenate(out).astype(np.int64)

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "size": self.size, "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        state = check_version("sampler", state, self.VERSION)
        if state["size"] != self.size or state["seed"] != self.seed:
            raise DataError(
                f"the dataset has {self.size} rows (seed {self.seed}) but the saved sampler was over "
                f"{state['size']} rows (seed {state['seed']}); resume with the same dataset"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)
