"""A generated sample: its one schema (:class:`Sample`) and its columnar form.

    id             int64     unique in the run, in order of generation
    index          int64     the dataset row of its prompt
    group          int64     the id of the first sample of its prompt's group (GRPO's n samples share it)
    score          float64   the reward the update uses: rule_reward + model.reward_model.weight * rm_score
    rule_reward    float64
    rm_score       float64
    policy_version int64     the policy that generated it: the step whose update produced the weights
                             (0 = the initial ones); a sync step s samples from version s-1. Journals
                             from before async rollout lack it: read as UNKNOWN_VERSION (their step - 1)
    prompt_ids     int32[]   (int64 in memory)
    response_ids   int32[]   (int64 in memory)
    gen_logprobs   float32[] per response token, as the rollout engine sampled it
    ref_logprobs   float32[] the reference model's, per response token (empty without a KL term)

Samples travel columnar — padded arrays plus lengths (:func:`pack`, :func:`unpack`) — in journal
events, snapshots and between ranks: live training and replay both go through them, so the update
sees bit-identical inputs either way. The columns are a map ``{field: array, field_len: lengths}``
read and written here only; :class:`Columns` is the read-only view the rest of the engine uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import numpy as np

SCALARS = {"id": np.int64, "index": np.int64, "group": np.int64, "score": np.float64, "rule_reward": np.float64, "rm_score": np.float64,
           "policy_version": np.int64}
UNKNOWN_VERSION = -1  # policy_version of a sample journaled before the field existed (its step - 1: all were sync)
SEQUENCES = {"prompt_ids": np.int32, "response_ids": np.int32, "gen_logprobs": np.float32, "ref_logprobs": np.float32}
FIELDS = {**SCALARS, **SEQUENCES}
PAD = -1  # fills token-id rows past their length in the columnar form (log-probs: 0)

_EMPTY_F32 = np.zeros(0, np.float32)


@dataclass(slots=True, eq=False)
class Sample:
    """One generated sample. Mutable while its step produces it (ids, rewards and reference
    log-probs are filled in as they become known); what is journaled is its packed form."""

    index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    gen_logprobs: np.ndarray
    id: int = -1
    group: int = -1
    score: float = 0.0
    rule_reward: float = 0.0
    rm_score: float = 0.0
    policy_version: int = UNKNOWN_VERSION
    ref_logprobs: np.ndarray = field(default_factory=lambda: _EMPTY_F32)

    def same_as(self, other: Sample) -> bool:
        """Every field equal, bit for bit (NaN equals NaN, -0.0 differs from 0.0), at its journaled dtype."""
        for name, dt in FIELDS.items():
            a, b = np.asarray(getattr(self, name), dt), np.asarray(getattr(other, name), dt)
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return True


assert {f.name for f in fields(Sample)} == set(FIELDS), "Sample and FIELDS must name the same fields"


def pack(samples: Iterable[Sample]) -> dict:
    """Samples as columns: each scalar field an array, each sequence field a padded 2-D array and
    `<field>_len` its lengths."""
    samples = list(samples)
    n = len(samples)
    out: dict = {k: np.array([getattr(s, k) for s in samples], dtype=dt) for k, dt in SCALARS.items()}
    for k, dt in SEQUENCES.items():
        seqs = [getattr(s, k) for s in samples]
        lens = np.array([len(x) for x in seqs], dtype=np.int32)
        width = int(lens.max()) if n else 0
        arr = np.full((n, width), PAD if dt is np.int32 else 0, dtype=dt)
        for i, x in enumerate(seqs):
            arr[i, : lens[i]] = x
        out[k] = arr
        out[k + "_len"] = lens
    return out


def unpack(cols: dict) -> list[Sample]:
    n = len(cols["id"])
    if "policy_version" not in cols:  # written before the field existed
        cols = {**cols, "policy_version": np.full(n, UNKNOWN_VERSION, np.int64)}
    scal = {k: cols[k].tolist() for k in SCALARS}
    out = []
    for i in range(n):
        seq = {k: cols[k][i, : cols[k + "_len"][i]].astype(np.int64 if dt is np.int32 else dt) for k, dt in SEQUENCES.items()}
        out.append(Sample(**{k: (int(v[i]) if SCALARS[k] is np.int64 else float(v[i])) for k, v in scal.items()}, **seq))
    return out


@dataclass(frozen=True)
class Columns:
    """A packed batch of samples (a `buffer.add` event's `samples`, read only): its size, ids, any
    column as the journal holds it, and its sequences without padding."""

    cols: dict

    @property
    def n(self) -> int:
        return len(self.cols["id"]) if "id" in self.cols else 0

    @property
    def ids(self) -> np.ndarray:
        return np.asarray(self.cols["id"], np.int64) if "id" in self.cols else np.zeros(0, np.int64)

    def has(self, name: str) -> bool:
        return name in self.cols

    def scalar(self, name: str, default: np.ndarray | None = None) -> np.ndarray:
        """A scalar column (`default`, or zeros, when the journal lacks it)."""
        if name in self.cols:
            return np.asarray(self.cols[name], SCALARS[name])
        return default if default is not None else np.zeros(self.n, SCALARS[name])

    def padded(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A sequence column as (padded 2-D array, lengths); empty when the journal lacks it."""
        arr = np.asarray(self.cols.get(name, np.zeros((self.n, 0))), SEQUENCES[name])
        lens = np.asarray(self.cols.get(name + "_len", np.zeros(self.n)), np.int64)
        return arr, lens

    def samples(self) -> list[Sample]:
        return unpack(self.cols)
