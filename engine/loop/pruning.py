"""Journal retention: which steps keep their samples, and pruning the rest (archived first if asked).

    journal.retain_samples: all                     nothing is pruned (the default)
                            since_oldest_snapshot   samples of steps up to the oldest kept snapshot go
                            N                       as above, but the last N steps keep theirs too

Every kept snapshot holds the rollout buffer's pending samples, so replay from any of them reads
only later steps' samples: pruning up to the oldest one never costs recovery anything. "Kept" is
what is on disk and whole (SnapshotStore.sound): an indexed snapshot deleted by hand, or one whose
manifest no longer checks, never sets the bound, so the older good one stays replayable. With
journal.local_dir, pruning waits until the shipped segments hold those steps whole and the index
that makes them unneeded (a rebuild from segments then prunes its copy the same way). What stays
of a pruned step: its record without the samples (data, seeds, sample ids added, dropped and
consumed, metrics, fingerprint), its checksum and place in the hash chain, its summary, and the
digest of the removed payload. Runs on rank 0 after each snapshot is published and rotated (the
only moment the bound moves), in the thread that published it.
"""

from __future__ import annotations

from pathlib import Path

from . import archive
from .snapshot_store import SnapshotStore


def prune_bound(policy: str, snapshot_steps: list[int], last_step: int) -> int:
    """The last step whose samples no kept snapshot needs under `policy` (0: none)."""
    policy = str(policy)
    if policy == "all" or not snapshot_steps:
        return 0
    bound = min(snapshot_steps)
    if policy != "since_oldest_snapshot":
        bound = min(bound, last_step - int(policy))
    return max(bound, 0)


def apply(run_dir: Path, cfg, ledger, reporter) -> tuple[int, int] | None:
    """Prune (and archive) what the policy allows now. Returns (steps pruned, bytes freed) or None."""
    jc = cfg.journal
    oldest = next(SnapshotStore(run_dir, ledger).sound(), None)  # the bound only needs the oldest sound one
    bound = prune_bound(jc.retain_samples, [] if oldest is None else [oldest], ledger.last_step())
    done = ledger.retention.pruned_through()
    if bound <= done:
        return None
    # the copy a recovery reads (shipped segments) must hold these steps whole, and the snapshot index
    # that makes them unneeded, before the samples leave this copy: a shipment reads frames as they are now
    ledger.make_durable()
    entry = archive.write(run_dir, ledger, max(done, ledger.base_step()) + 1, bound) if jc.archive else None
    pruned, freed = ledger.retention.prune(bound, entry)
    where = f", archived to {archive.ARCHIVE_DIR}/{entry.file}" if entry else ""
    size = f"{freed / 2**20:.1f} MiB" if freed >= 2**20 else f"{freed / 1024:.0f} KiB"
    reporter.info(f"Journal retention: samples of steps through {bound} pruned ({pruned} steps, {size}){where}")
    return pruned, freed
