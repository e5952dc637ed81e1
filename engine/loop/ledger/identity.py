"""The run's identity in the journal's meta: what the run is (its config, seed, versions, topology,
creation, git commit, what the trainer loaded), a fork's parent, a what-if's source, and the config
and topology in force from each resume on (the records: ``loop.records``). The meta keys are named
here and in the ledger's other parts, nowhere else.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

from verlj.journal import Journal

from ...config import stored_config
from ...errors import RunError
from ...state.topology import Topology
from ..records import ConfigEntry, Counterfactual, Loaded, ParentRun, TopologyChange

# meta keys
CONFIG, HISTORY, TOPOLOGY = "config", "config_history", "topology_history"
PARENT, COUNTERFACTUAL = "parent", "counterfactual"
VERSIONS, GIT_COMMIT = "versions", "git_commit"
WORLD_SIZE, TP_SIZE = "world_size", "tensor_parallel_size"
RUN_DIR, CREATED = "run_dir", "created"
RUN_TOKEN = "run_token"  # what names the run in its tool calls' idempotency keys (rollout.tools): the same for all its processes


def config_changes(stored: list[dict] | None) -> list[ConfigEntry]:
    """The config changes as stored (the meta's config_history), each config in its stored form."""
    return [ConfigEntry(e.from_step, stored_config(e.config)) for e in map(ConfigEntry.from_dict, stored or [])]


class RunIdentity:
    """The run's identity, its parent and its config and topology history (``ledger.identity``)."""

    def __init__(self, journal: Journal):
        self.journal = journal

    def record_start(self, values: dict[str, Any], parent: dict | None, base_step: int, chain_base: str | None,
                     counterfactual: dict | None) -> None:
        """Write a new run's identity `values` (a fork's: with its parent, its journal continuing the
        parent's hash chain after `base_step`; a what-if's: with its `counterfactual`), in one transaction."""
        if counterfactual:
            values = {**values, COUNTERFACTUAL: counterfactual}
        if parent is None:
            self.journal.meta.update(values)
        else:
            # None for a fork at its parent's own base step, whose record the parent's journal does not
            # hold (Journal.chain_hash): stored as it is given, as before
            self.journal.writer.start_after(base_step, cast(str, chain_base), {**values, PARENT: parent})

    def all(self) -> dict[str, Any]:
        """Everything recorded about the run (config, versions, topology, ...)."""
        return self.journal.meta.all()

    def loaded(self) -> Loaded:
        """What the trainer loaded when the run started (a resume checks it is the same)."""
        return Loaded.from_dict(self.all())

    def run_token(self) -> str:
        """What names the run in its tool calls' idempotency keys: recorded at its start (a run recorded before tokens were:
        one made of its directory and its start's time, the same for every process of it)."""
        return self.get(RUN_TOKEN) or hashlib.sha256(f"{self.get(RUN_DIR)}\n{self.get(CREATED)}".encode()).hexdigest()[:16]

    def get(self, key: str, default: Any = None) -> Any:
        """One identity fact (e.g. 'world_size', 'reward_model_digest')."""
        return self.journal.meta.get(key, default)

    def parent(self) -> dict | None:
        """The parent as stored (ParentRun's map): what the post-mortem readers show."""
        return self.journal.meta.get(PARENT)

    def parent_run(self) -> ParentRun | None:
        """A fork's (or a what-if's) parent; None for a run that was not forked."""
        parent = self.parent()
        return None if parent is None else ParentRun.from_dict(parent)

    def base_fingerprint(self) -> str | None:
        """A fork's state at its base step (which its journal does not hold): the parent's after that
        step under the fork's config (a what-if's too; forks made before this was recorded: the
        parent's fingerprint). None for a run that was not forked."""
        parent = self.parent_run()
        if parent is None:
            return None
        return parent.base_fingerprint if parent.base_fingerprint is not None else parent.fingerprint

    def counterfactual(self) -> dict | None:
        """A what-if's Counterfactual, as stored (the map crosses ranks as it is); None for a run
        trained on its own samples."""
        return self.journal.meta.get(COUNTERFACTUAL)

    def whatif_of(self) -> Counterfactual | None:
        """A what-if's Counterfactual: the run whose samples it trains on; None for a run trained on its own samples."""
        cf = self.counterfactual()
        return None if cf is None else Counterfactual.from_dict(cf)

    # ------------------------------------------------------------------ config history

    def first_config(self) -> dict:
        cfg = self.journal.meta.get(CONFIG)
        if cfg is None:
            raise RunError(f"{self.journal.path.parent} has a journal but no stored config; it was not written by verlj train")
        return stored_config(cfg)

    def config_changes(self) -> list[ConfigEntry]:
        """The changes made on resume, in order."""
        return config_changes(self.journal.meta.get(HISTORY))

    def record_config_change(self, from_step: int, config: dict) -> None:
        self.journal.meta.set(HISTORY, [*(self.journal.meta.get(HISTORY) or []), ConfigEntry(from_step, config).to_dict()])

    # ------------------------------------------------------------------ topology history

    def topology_start(self, first_config: dict) -> Topology:
        """The topology of the run's start (`first_config`: its first config)."""
        return Topology(self.get(WORLD_SIZE, 1), self.get(TP_SIZE, 1),
                        first_config.get("distributed", {}).get("zero_stage", 0))  # read as stored: inspect reads it anywhere

    def topology_history(self) -> list[dict]:
        """The TopologyChange entries as stored (what the post-mortem readers show)."""
        return list(self.journal.meta.get(TOPOLOGY) or [])

    def topology_changes(self) -> list[TopologyChange]:
        """The resumes that changed the world size, ZeRO stage or TP size, in order."""
        return [TopologyChange.from_dict(e) for e in self.topology_history()]

    def record_topology_change(self, change: TopologyChange) -> None:
        """A resume's TopologyChange, after those recorded (kept as they were stored)."""
        self.journal.meta.set(TOPOLOGY, [*self.topology_history(), change.to_dict()])
