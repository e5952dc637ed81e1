"""The records a run's ledger keeps in the journal's meta (loop.ledger reads and writes them there):
each a frozen dataclass whose map is the very one earlier releases stored, and :class:`History`, what
was in force at any step, as a resume or a replay needs it. Plain data: no journal, no torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..schema.events import ControlKind


def _plain(value: Any) -> Any:
    if isinstance(value, MetaRecord):
        return value.to_dict()
    return value.value if isinstance(value, enum.Enum) else value


@dataclass(frozen=True)
class MetaRecord:
    """A record the ledger keeps in the journal's meta (or a file beside it). Its fields are declared
    in the order the stored map holds its keys, so `to_dict()` gives the very map earlier releases
    wrote, and `from_dict()` reads theirs (a key an older writer did not write: the field's default;
    a key no field names: ignored). The one place these maps are read and written by key."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset()  # fields left out of the map while None
    SPELLED: ClassVar[dict[str, str]] = {}  # field -> its key in the map, where that key is no Python name

    def to_dict(self) -> dict:
        return {self.SPELLED.get(f.name, f.name): _plain(getattr(self, f.name)) for f in fields(self)
                if not (f.name in self.OPTIONAL and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, data: dict):
        names = {f.name: f.name for f in fields(cls)} | {key: name for name, key in cls.SPELLED.items()}
        return cls(**{names[k]: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Loaded(MetaRecord):
    """What the trainer loaded that the config alone does not pin, as the run's identity records it
    (Trainer.identity): the prompts' identity (rl.data.DataIdentity's map) and the frozen reward
    model's digest (runs from before a field: None)."""

    dataset: dict | None = None
    reward_model_digest: str | None = None
    actor_base_path: str | None = None  # with LoRA: the frozen base (rl.lora.base_identity)
    actor_base_digest: str | None = None


@dataclass(frozen=True)
class SnapshotEntry(MetaRecord):
    """One snapshot in the index: its directory (in the run directory), the fingerprint of its state,
    the BLAKE3 of its manifest.json, when it was published (entries from before a field: None)."""

    OPTIONAL = frozenset({"fingerprint", "manifest", "time"})
    path: str
    fingerprint: str | None = None
    manifest: str | None = None
    time: float | None = None


@dataclass(frozen=True)
class ParentRun(MetaRecord):
    """A fork's (or a what-if's) parent: the run, the step it was forked after, the parent's fingerprint
    there, and the state's under the fork's config (forks made before this was recorded: None)."""

    run: str
    step: int
    fingerprint: str | None = None
    base_fingerprint: str | None = None


@dataclass(frozen=True)
class Counterfactual(MetaRecord):
    """A what-if (loop.whatif): the run whose samples it trains on, the steps, the overrides and the keys they changed."""

    run: str
    from_step: int
    to_step: int
    overrides: list
    changed: list


@dataclass(frozen=True)
class LineageEntry(MetaRecord):
    """A start, fork, what-if or resume of the run. A resume says from which snapshot, the config keys it
    changed, its world size and library versions (and those that moved since), and the
    trainer.resume_from it was asked for. `parent`: a fork's, filled in by Ledger.lineage_entries (never stored)."""

    OPTIONAL = frozenset({"snapshot_step", "config_changes", "world_size", "time", "versions", "resume_from",
                          "versions_changed", "parent"})
    kind: ControlKind
    at_step: int
    snapshot_step: int | None = None
    config_changes: list | None = None
    world_size: int | None = None
    time: str | None = None
    versions: dict | None = None
    resume_from: str | None = None
    versions_changed: list | None = None
    parent: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "kind", ControlKind(self.kind))

    @property
    def forked(self) -> bool:
        return self.kind in (ControlKind.FORK, ControlKind.WHATIF)


def attempt_at(entries: list[LineageEntry], step: int) -> int:
    """How many processes of a run have begun live step `step` (at least 1): each start, fork or resume began at the
    step after its `at_step` and went on until the next one began, so a process that stopped with `step` not yet
    committed began it, and so does the one after. An upper bound for a step whose process stopped between its
    previous commit and its own collect. What an agent episode of `step` in step order is told (its attempt)."""
    starts = sorted(e.at_step for e in entries)
    return max(1, sum(1 for k, at in enumerate(starts) if at < step <= (starts[k + 1] + 1 if k + 1 < len(starts) else step)))


@dataclass(frozen=True)
class ConfigEntry(MetaRecord):
    """A config change made on resume: the config in force from `from_step` on."""

    from_step: int
    config: dict


@dataclass(frozen=True)
class Rebased(MetaRecord):
    step: int
    fingerprint: str


@dataclass(frozen=True)
class TopologyChange(MetaRecord):
    """A resume that changed the world size, ZeRO stage or TP size (or left the journal's reference
    line: a resharded snapshot): `topology` runs the steps from `from_step` on; `rebased` is the state
    after `rebased.step` as that resume replayed it under the new topology, the reference for the steps
    from `from_step` on. The rest says how the resume got there (recovery: the `topology` control
    event's details are these, with `to` for `topology`)."""

    SPELLED = {"before": "from"}
    from_step: int
    topology: dict
    before: dict | None = None
    snapshot_step: int | None = None
    resharded: dict | None = None
    replayed: list | None = None
    tolerance: dict | None = None
    checked_steps: int | None = None
    max_deviation: dict | None = None
    rebased: Rebased | None = None

    def __post_init__(self):
        if isinstance(self.rebased, dict):
            object.__setattr__(self, "rebased", Rebased.from_dict(self.rebased))

    def details(self) -> dict:
        """The entry less `from_step` and `topology`: how the resume got there."""
        return {k: v for k, v in self.to_dict().items() if k not in ("from_step", "topology")}

    def control_details(self) -> dict:
        """The details of the `topology` control event: from, to, then how."""
        how = self.details()
        return {"from": self.before, "to": self.topology, **{k: v for k, v in how.items() if k != "from"}}


@dataclass(frozen=True)
class ArchiveEntry(MetaRecord):
    """One file of the rollout archive (loop.archive): its name in RUN/rollouts, the steps whose samples
    it holds, its rows, bytes and BLAKE3 digest."""

    file: str
    first: int
    last: int
    rows: int
    bytes: int
    digest: str

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last


@dataclass(frozen=True)
class TrainMetadata(MetaRecord):
    """RUN/train_metadata.json: a human-readable view of the ledger, as the tutorial shows it."""

    global_step: int | None = None
    epoch: int | None = None
    samples_seen: int | None = None
    last_save_time: str | None = None
    last_snapshot: str | None = None
    git_commit: str | None = None
    config_hash: str | None = None
    resume_from: str | None = None


def config_in_force(first: dict, changes: list[ConfigEntry], step: int) -> dict:
    cfg = first
    for entry in changes:
        if entry.from_step <= step:
            cfg = entry.config
    return cfg


@dataclass
class History:
    """A run's history as a resume or a replay needs it: read on rank 0 (Ledger.history) and sent to
    every rank once (Run.history), so no rank asks the journal again. The one owner of "what was in
    force at step N"."""

    base_step: int  # the step before the journal's first (a fork's parent step; 0 for a new run)
    last_step: int
    pruned_through: int  # the last step whose samples retention removed (0: none)
    first_config: dict
    config_changes: list[ConfigEntry]  # the changes made on resume, in order
    topology_start: dict  # {world_size, tensor_parallel_size, zero_stage} of the run's start
    topology_changes: list[TopologyChange]  # in order (Ledger.topology_changes)
    # [after_step, versions]: what the start (-1) and each resume ran on (versions and hardware: loop.provenance)
    produced_on: list = field(default_factory=list)

    def __post_init__(self):  # from to_dict's maps, as they cross ranks
        self.config_changes = [e if isinstance(e, ConfigEntry) else ConfigEntry.from_dict(e) for e in self.config_changes]
        self.topology_changes = [e if isinstance(e, TopologyChange) else TopologyChange.from_dict(e) for e in self.topology_changes]

    def config_at(self, step: int) -> dict:
        return config_in_force(self.first_config, self.config_changes, step)

    def configs_in(self, first: int, last: int) -> list[dict]:
        """The configs in force for steps first..last: the one at `first`, then each change up to `last`."""
        return [self.config_at(first), *(e.config for e in self.config_changes if first < e.from_step <= last)]

    def topology_at(self, step: int) -> dict:
        topo = self.topology_start
        for entry in self.topology_changes:
            if entry.from_step <= step:
                topo = entry.topology
        return topo

    def versions_at(self, step: int) -> dict[str, str]:
        """The versions (and hardware) in force when `step` was trained: those of the last start or resume before it."""
        return versions_in_force_at(self.produced_on, step)

    def to_dict(self) -> dict:
        """Plain data (History(**it) is this history again)."""
        return {"base_step": self.base_step, "last_step": self.last_step, "pruned_through": self.pruned_through,
                "first_config": self.first_config, "config_changes": [e.to_dict() for e in self.config_changes],
                "topology_start": self.topology_start, "topology_changes": [e.to_dict() for e in self.topology_changes],
                "produced_on": self.produced_on}


def versions_in_force_at(produced_on: list, step: int) -> dict[str, str]:
    """Of [after_step, versions] pairs in order (a start's at -1, then each resume's), those in force when `step` was trained."""
    found: dict[str, str] = {}
    for after, versions in produced_on:
        if after < step and versions:
            found = versions
    return found
