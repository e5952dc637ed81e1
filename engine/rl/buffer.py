"""The rollout buffer: samples (rl.samples) waiting for an update, in arrival order."""

from __future__ import annotations

from ..state.stateful import check_version
from .samples import pack, unpack


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
        return {"version": self.VERSION, "next_id": self.next_id, "samples": pack(list(self.samples.values()))}

    def load_state_dict(self, state: dict) -> None:
        state = check_version("rollout buffer", state, self.VERSION)
        self.samples = {s["id"]: s for s in unpack(state["samples"])}
        self.next_id = int(state["next_id"])
