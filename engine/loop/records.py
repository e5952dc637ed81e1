"""The records a run's ledger keeps in the journal's meta (loop.ledger reads and writes them there):
each a frozen dataclass whose map is the very one earlier releases stored, made from its fields by the
one codec of verlj's records (``schema.record``: the fields in the order the map holds its keys, a key
an older writer did not write read as the field's default, a key no field names ignored), and
:class:`History`, what was in force at any step, as a resume or a replay needs it. Plain data: no
journal, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..schema.events import ControlKind
from ..schema.record import Record, stored
from ..state.topology import Topology

OPT = stored(optional=True)  # left out of the stored map while None (the maps of releases from before the field)


def now_iso() -> str:
    """Now, as the records store a time (UTC, to the second)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Loaded(Record):
    """What the trainer loaded that the config alone does not pin, as the run's identity records it
    (Trainer.identity): the prompts' identity (rl.data.DataIdentity's map) and the frozen reward
    model's digest (runs from before a field: None)."""

    dataset: dict[str, Any] | None = None  # rl.data.DataIdentity's map, as recorded (read there)
    reward_model_digest: str | None = None
    actor_base_path: str | None = None  # with LoRA: the frozen base (rl.lora.base_identity)
    actor_base_digest: str | None = None


@dataclass(frozen=True)
class SnapshotEntry(Record):
    """One snapshot in the index: its directory (in the run directory), the fingerprint of its state,
    the BLAKE3 of its manifest.json, when it was published (entries from before a field: None)."""

    path: str
    fingerprint: str | None = field(default=None, metadata=OPT)
    manifest: str | None = field(default=None, metadata=OPT)
    time: float | None = field(default=None, metadata=OPT)


@dataclass(frozen=True)
class Unindexed(Record):
    """A snapshot taken out of the index (ledger.snapshots): found damaged and moved aside to `path` (in the
    run directory: quarantined), or named by the index but gone from disk (missing: a resume unindexed it);
    when (entries from before a field: None)."""

    name: str
    step: int | None = None
    reason: str | None = None
    path: str | None = field(default=None, metadata=OPT)  # quarantined: where it went; missing: not stored
    time: str | None = None


@dataclass(frozen=True)
class ParentRun(Record):
    """A fork's (or a what-if's) parent: the run, the step it was forked after, the parent's fingerprint
    there, and the state's under the fork's config (forks made before this was recorded: None)."""

    run: str
    step: int
    fingerprint: str | None = None
    base_fingerprint: str | None = None


@dataclass(frozen=True)
class Counterfactual(Record):
    """A what-if (loop.whatif): the run whose samples it trains on, the steps, the overrides and the keys they changed."""

    run: str
    from_step: int
    to_step: int
    overrides: list[str]  # KEY=VALUE, as given
    changed: list[str]  # the dotted keys they changed


@dataclass(frozen=True)
class LineageEntry(Record):
    """A start, fork, what-if or resume of the run. A resume says from which snapshot, the config keys it
    changed, its world size and library versions (and those that moved since), and the
    trainer.resume_from it was asked for. `parent`: a fork's, filled in by ledger.lineage.entries (never stored)."""

    kind: ControlKind
    at_step: int
    snapshot_step: int | None = field(default=None, metadata=OPT)
    config_changes: list[str] | None = field(default=None, metadata=OPT)  # the dotted keys
    world_size: int | None = field(default=None, metadata=OPT)
    time: str | None = field(default=None, metadata=OPT)
    versions: dict[str, str] | None = field(default=None, metadata=OPT)  # loop.provenance.produced_on
    resume_from: str | None = field(default=None, metadata=OPT)
    versions_changed: list[str] | None = field(default=None, metadata=OPT)  # 'name old → new'
    # ParentRun's map as the run stored it (a fork from before base_fingerprint lacks it: shown as it is)
    parent: dict[str, Any] | None = field(default=None, metadata=OPT)

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
class ConfigEntry(Record):
    """A config change made on resume: the config in force from `from_step` on."""

    from_step: int
    config: dict[str, Any]  # the config as stored (config.stored_config reads it)


@dataclass(frozen=True)
class Rebased(Record):
    step: int
    fingerprint: str


@dataclass(frozen=True)
class Resharded(Record):
    """A snapshot loaded from another topology (loop.checkpointer: Checkpointer.load): from which, to which,
    and how long its conversion to the universal form took (0 and `cached`: a valid converted form was on
    disk). A TopologyChange holds it as it is."""

    before: Topology = field(metadata=stored(key="from"))
    after: Topology = field(metadata=stored(key="to"))
    convert_s: float
    cached: bool


@dataclass(frozen=True)
class Deviation(Record):
    """A replayed metric's deviation from the journaled one (loop.recovery, under another topology)."""

    step: int
    metric: str
    replayed: float
    journaled: float
    deviation: float


@dataclass(frozen=True)
class TopologyChange(Record):
    """A resume that changed the world size, ZeRO stage or TP size (or left the journal's reference
    line: a resharded snapshot): `topology` runs the steps from `from_step` on; `rebased` is the state
    after `rebased.step` as that resume replayed it under the new topology, the reference for the steps
    from `from_step` on. The rest says how the resume got there (recovery: the `topology` control
    event's details are these, with `to` for `topology`)."""

    from_step: int
    topology: Topology
    before: Topology | None = field(default=None, metadata=stored(key="from"))
    snapshot_step: int | None = None
    resharded: Resharded | None = None
    replayed: list[int] | None = None  # [first, last] replayed
    tolerance: dict[str, float] | None = None  # {rtol, atol} the replayed metrics were checked within
    checked_steps: int | None = None
    max_deviation: Deviation | None = None
    rebased: Rebased | None = None

    def details(self) -> dict:
        """The entry's map less `from_step` and `topology`: how the resume got there."""
        return {k: v for k, v in self.to_dict().items() if k not in ("from_step", "topology")}

    def control_details(self) -> dict:
        """The details of the `topology` control event: from, to, then how."""
        before = None if self.before is None else self.before.to_dict()
        return {"from": before, "to": self.topology.to_dict(), **{k: v for k, v in self.details().items() if k != "from"}}


@dataclass(frozen=True)
class ArchiveEntry(Record):
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
class TrainMetadata(Record):
    """RUN/train_metadata.json: a human-readable view of the ledger, as the tutorial shows it."""

    global_step: int | None = None
    epoch: int | None = None
    samples_seen: int | None = None
    last_save_time: str | None = None
    last_snapshot: str | None = None
    git_commit: str | None = None
    config_hash: str | None = None
    resume_from: str | None = None


@dataclass(frozen=True)
class ProducedOn(Record):
    """What a start or a resume ran on (versions and hardware: loop.provenance), in force for the steps after
    `after` (a start's: -1) until the next."""

    after: int
    versions: dict[str, str]


def config_in_force(first: dict, changes: list[ConfigEntry], step: int) -> dict:
    cfg = first
    for entry in changes:
        if entry.from_step <= step:
            cfg = entry.config
    return cfg


@dataclass(frozen=True)
class History(Record):
    """A run's history as a resume or a replay needs it: read on rank 0 (Ledger.history) and sent to
    every rank once (Run.history: its map, read back with from_dict), so no rank asks the journal again.
    The one owner of "what was in force at step N"."""

    base_step: int  # the step before the journal's first (a fork's parent step; 0 for a new run)
    last_step: int
    pruned_through: int  # the last step whose samples retention removed (0: none)
    first_config: dict[str, Any]  # as stored (config.stored_config)
    config_changes: list[ConfigEntry]  # the changes made on resume, in order
    topology_start: Topology  # the run's start's
    topology_changes: list[TopologyChange]  # in order (ledger.identity.topology_changes)
    produced_on: list[ProducedOn] = field(default_factory=list)  # the start's and each resume's, in order

    def config_at(self, step: int) -> dict:
        return config_in_force(self.first_config, self.config_changes, step)

    def configs_in(self, first: int, last: int) -> list[dict]:
        """The configs in force for steps first..last: the one at `first`, then each change up to `last`."""
        return [self.config_at(first), *(e.config for e in self.config_changes if first < e.from_step <= last)]

    def topology_at(self, step: int) -> Topology:
        topo = self.topology_start
        for entry in self.topology_changes:
            if entry.from_step <= step:
                topo = entry.topology
        return topo

    def versions_at(self, step: int) -> dict[str, str]:
        """The versions (and hardware) in force when `step` was trained: those of the last start or resume before it."""
        return versions_in_force_at(self.produced_on, step)


def versions_in_force_at(produced_on: list[ProducedOn], step: int) -> dict[str, str]:
    """Of what each start and resume ran on, in order, the versions in force when `step` was trained."""
    found: dict[str, str] = {}
    for p in produced_on:
        if p.after < step and p.versions:
            found = p.versions
    return found
