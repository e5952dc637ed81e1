"""Rollout samples and the rollout buffer.

A sample is a dict: ``id``, ``index`` (dataset row), ``group`` (one prompt's n samples share it),
``prompt_ids``, ``response_ids`` (int64 arrays), ``gen_logprobs`` and ``ref_logprobs`` (float32, per
response token; the reference's are empty when no KL term uses them),
``score`` (float64: the reward the update uses), ``rule_reward``, ``rm_score``.

Samples travel columnar (padded arrays plus lengths) in journal events and snapshots; live
training and replay both go through :func:`pack_samples` / :func:`unpack_samples`, so the update
sees bit-identical inputs either way.
"""

from __future__ import annotations

import numpy as np

PAD = -1
SCALAR_FIELDS = {"id": np.int64, "index": np.int64, "group": np.int64, "score": np.float64, "rule_reward": np.float64, "rm_score": np.float64}
SEQ_FIELDS = {"prompt_ids": np.int32, "response_ids": np.int32, "gen_logprobs": np.float32, "ref_logprobs": np.float32}


def pack_samples(samples: list[dict]) -> dict:
    n = len(samples)
    out: dict = {k: np.array([s[k] for s in samples], dtype=dt) for k, dt in SCALAR_FIELDS.items()}
    for k, dt in SEQ_FIELDS.items():
        lens = np.array([len(s[k]) for s in samples], dtype=np.int32)
        width = int(lens.max()) if n else 0
        arr = np.full((n, width), PAD if dt is np.int32 else 0, dtype=dt)
        for i, s in enumerate(samples):
            arr[i, : lens[i]] = s[k]
        out[k] = arr
        out[k + "_len"] = lens
    return out


def unpack_samples(cols: dict) -> list[dict]:
    n = len(cols["id"])
    out = []
    for i in range(n):
        s = {k: (int(cols[k][i]) if dt is np.int64 else float(cols[k][i])) for k, dt in SCALAR_FIELDS.items()}
        for k, dt in SEQ_FIELDS.items():
            s[k] = cols[k][i, : cols[k + "_len"][i]].astype(np.int64 if dt is np.int32 else dt)
        out.append(s)
    return out


class RolloutBuffer:
    """Samples waiting for an update, in arrival order. Stateful: state_dict / load_state_dict."""

    VERSION = 1

    def __init__(self):
        self.samples: dict[int, dict] = {}
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, samples: list[dict]) -> None:
        for s in samples:
            assert s["id"] not in self.samples, f"sample {s['id']} added twice"
            self.samples[s["id"]] = s
            self.next_id = max(self.next_id, s["id"] + 1)

    def drop(self, ids) -> None:
        for i in ids:
            del self.samples[int(i)]

    def consume(self, ids) -> list[dict]:
        return [self.samples.pop(int(i)) for i in ids]

    def groups(self) -> dict[int, list[int]]:
        """group -> sample ids, groups in arrival order."""
        out: dict[int, list[int]] = {}
        for sid, s in self.samples.items():
            out.setdefault(s["group"], []).append(sid)
        return out

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "next_id": self.next_id, "samples": pack_samples(list(self.samples.values()))}

    def load_state_dict(self, state: dict) -> None:
        assert state["version"] == self.VERSION, f"buffer state version {state['version']}"
        self.samples = {s["id"]: s for s in unpack_samples(state["samples"])}
        self.next_id = int(state["next_id"])
