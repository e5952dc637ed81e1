"""The rollout buffer: samples (schema.sample) waiting for an update, in arrival order."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..schema.sample import Sample, pack, unpack
from ..state.stateful import check_version


class RolloutBuffer:
    """Samples waiting for an update, in arrival order; (async rollout, step order) the plans: which of
    them each future step will train on, decided when its batch was generated; (completion order) the
    requests: groups asked of the generator whose samples have not arrived. Stateful."""

    VERSION = 3  # 2: plans; 3: requests

    def __init__(self):
        self.samples: dict[int, Sample] = {}
        self.next_id = 0
        self.plans: dict[int, np.ndarray] = {}  # step -> the sample ids it will consume (async rollout)
        self.requests: dict[int, int] = {}  # completion order: group (its first sample id) -> dataset row, in order asked

    def request(self, groups, rows, group_size: int) -> None:
        """Groups asked of the generator: their samples will have ids group .. group + group_size - 1."""
        for g, row in zip(groups, rows):
            assert int(g) not in self.requests, f"group {g} requested twice"
            self.requests[int(g)] = int(row)
            self.next_id = max(self.next_id, int(g) + group_size)

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, samples: list[Sample]) -> None:
        for s in samples:
            assert s.id not in self.samples, f"sample {s.id} added twice"
            self.samples[s.id] = s
            self.next_id = max(self.next_id, s.id + 1)
            self.requests.pop(s.group, None)

    def drop(self, ids) -> None:
        for i in ids:
            del self.samples[int(i)]

    def consume(self, ids) -> list[Sample]:
        return [self.samples.pop(int(i)) for i in ids]

    def groups(self) -> dict[int, list[int]]:
        """group -> sample ids not planned for a step yet, groups in arrival order."""
        planned = {int(i) for ids in self.plans.values() for i in ids}
        out: dict[int, list[int]] = {}
        for sid, s in self.samples.items():
            if sid not in planned:
                out.setdefault(s.group, []).append(sid)
        return out

    def admit(self, samples: list[Sample], dropped, plans: dict[int, np.ndarray]) -> None:
        """A finished batch enters: its samples, less the dropped ids (its own zero-variance groups, and
        waiting groups too stale), with its plans. Live steps and replay both come through here."""
        self.add(samples)
        self.drop(dropped)
        self.plan(plans)

    def plan(self, plans: dict[int, np.ndarray]) -> None:
        for step, ids in plans.items():
            assert step not in self.plans, f"step {step} planned twice"
            self.plans[int(step)] = np.asarray(ids, dtype=np.int64)

    def planned_through(self) -> int | None:
        """The last step whose batch is planned, None when none is."""
        return max(self.plans) if self.plans else None

    def state_dict(self) -> dict:
        steps = sorted(self.plans)
        return vars_of(BufferState(self.VERSION, self.next_id, pack(list(self.samples.values())), steps, [self.plans[s] for s in steps],
                                  np.asarray(list(self.requests), np.int64), np.asarray(list(self.requests.values()), np.int64)))

    def load_state_dict(self, state: dict) -> None:
        saved = BufferState(**check_version("rollout buffer", state, self.VERSION, oldest=1))
        self.samples = {s.id: s for s in unpack(saved.samples)}
        self.next_id = int(saved.next_id)
        self.plans = {int(s): np.asarray(ids, dtype=np.int64) for s, ids in zip(saved.plan_steps, saved.plans)}
        self.requests = {int(g): int(r) for g, r in zip(saved.request_groups, saved.request_rows)}


def vars_of(state) -> dict:
    """A dataclass's fields as a map, in their order, the values themselves (not copied, as asdict would)."""
    return {f.name: getattr(state, f.name) for f in fields(state)}


@dataclass(frozen=True)
class BufferState:
    """The buffer's part of a snapshot (its anchor), field for field; versions before 2 lack the plans,
    before 3 the requests."""

    version: int
    next_id: int
    samples: dict  # the waiting samples, columnar (schema.sample.pack)
    plan_steps: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    request_groups: Any = ()
    request_rows: Any = ()
