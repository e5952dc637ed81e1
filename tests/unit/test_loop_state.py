"""The loop's state in-process, without a trainer: the ledger and its history, the snapshot store's
publish / rotate / quarantine / adoption, the retention bound, the checkpoint schedule, and recovery's
choice of a snapshot. Real LMDB journals and real directories; no torch."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from verlj.engine.config import make_config
from verlj.engine.errors import ReplayError, SnapshotError
from verlj.engine.loop.ledger import Ledger
from verlj.engine.loop.mirror import Mirror, mirror_root
from verlj.engine.loop.policy import CheckpointSchedule
from verlj.engine.loop.provenance import versions
from verlj.engine.loop.pruning import apply as apply_retention
from verlj.engine.loop.pruning import prune_bound
from verlj.engine.loop.records import ArchiveEntry, Deviation, ProducedOn, Rebased, Resharded, TopologyChange
from verlj.engine.loop.recovery import choose_snapshot, resolve_explicit
from verlj.engine.loop.snapshot_store import ADOPT, KEEP, QUARANTINE, REMOVE, UNINDEX, SnapshotStore
from verlj.engine.state.manifest import ANCHOR, META, Manifest, SnapshotMeta
from verlj.engine.state.topology import Topology
from verlj.journal import Journal, make_event, packb, unpackb


class Said:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)

    warn = info


def fp(step: int) -> str:
    return f"{step:064x}"


@pytest.fixture
def run(tmp_path):
    """A run directory whose journal holds steps 1..6 (fingerprint of step s: fp(s))."""
    j = Journal.open_writer(tmp_path / "journal")
    ledger = Ledger(j)
    cfg = make_config(None, ["trainer.total_steps=6"])
    ledger.start({"config": cfg.to_stored(), "world_size": 2, "tensor_parallel_size": 1, "versions": {"torch": "1"}})
    for s in range(1, 7):
        j.writer.append_step(s, [make_event("metrics", values={"loss": s / 10}), make_event("state", fingerprint=fp(s), parts={})])
    yield tmp_path, ledger
    j.close()


def snapshot(run_dir, ledger, step, fingerprint=None, publish=True):
    """A snapshot directory of `step` with the files a manifest check reads; published through the store."""
    tmp = run_dir / f".tmp-step_{step:05d}"
    tmp.mkdir()
    (tmp / META).write_text(json.dumps({"step": step, "fingerprint": fingerprint or fp(step), "time": 1.0}))
    (tmp / ANCHOR).write_bytes(packb({"sampler": {"cursor": step, "epoch": 0}, "buffer": {"samples": {"id": []}}}))
    (tmp / "weights.bin").write_bytes(bytes([step]) * 64)
    if publish:
        return SnapshotStore(run_dir, ledger).publish(step, fingerprint or fp(step), tmp)
    SnapshotStore.publish_standalone(tmp, run_dir / f"step_{step:05d}")  # with its manifest, never indexed (a kill before indexing)
    return run_dir / f"step_{step:05d}"


# ----------------------------------------------------------------------------- the ledger


def test_history_is_what_was_in_force_at_each_step(run):
    _run_dir, ledger = run
    lr = make_config(None, ["trainer.total_steps=6", "model.actor.optim.lr=0.002"]).to_stored()
    ledger.identity.record_config_change(4, lr)
    ledger.identity.record_topology_change(TopologyChange(5, Topology(1, 1, 0), rebased=Rebased(4, fp(4))))
    h = ledger.history()
    assert (h.base_step, h.last_step, h.pruned_through) == (0, 6, 0)
    assert [h.config_at(s)["model"]["actor"]["optim"]["lr"] for s in (1, 3, 4, 6)] == [0.001, 0.001, 0.002, 0.002]
    assert h.topology_at(4) == Topology(2, 1, 0) and h.topology_at(5) == Topology(1, 1, 0)
    assert ledger.config_at(5) == h.config_at(5)  # the ledger answers through its history
    assert type(h).from_dict(unpackb(packb(h.to_dict()))) == h  # what crosses ranks comes back whole, typed
    assert isinstance(h.topology_changes[0].rebased, Rebased) and isinstance(h.produced_on[0], ProducedOn)


def test_a_resume_records_its_own_choice_and_the_versions_that_moved(run):
    _run_dir, ledger = run
    moved = ledger.lineage.record_resume(6, 4, ["trainer.total_steps"], 1, versions(), resume_from="4")
    assert moved and all(m.startswith("torch 1 → ") for m in moved[:1])
    entry = ledger.lineage.entries()[-1]
    assert entry.resume_from == "4" and entry.versions_changed == moved
    assert ledger.lineage.record_resume(6, 6, [], 1, versions()) == []  # compared with the last start: nothing moved since
    assert ledger.lineage.entries()[-1].resume_from is None and "resume_from" not in ledger.lineage.entries()[-1].to_dict()
    assert ledger.config_at(6)["trainer"]["resume_from"] is None


def test_the_ledgers_records_store_the_maps_of_the_previous_release(run):
    """The typed records write the journal meta the previous release wrote, key for key and in order
    (its journals read back through them; tests/fixtures/v0 holds such journals)."""
    run_dir, ledger = run
    ledger.lineage.record_resume(6, 4, ["trainer.total_steps"], 1, versions(), resume_from="4")
    cfg = make_config(None, ["trainer.total_steps=8"]).to_stored()
    ledger.identity.record_config_change(7, cfg)
    one, two = {"world_size": 1, "tensor_parallel_size": 1, "zero_stage": 0}, {"world_size": 2, "tensor_parallel_size": 1, "zero_stage": 0}
    change = TopologyChange(7, Topology(1, 1, 0), Topology(2, 1, 0), 4, None, [5, 6], {"rtol": 1e-3, "atol": 1e-5}, 2, None, Rebased(6, fp(6)))
    ledger.identity.record_topology_change(change)
    resharded = TopologyChange(9, Topology(1, 1, 0), Topology(1, 1, 0), 8, Resharded(Topology(2, 1, 0), Topology(1, 1, 0), 0.5, False),
                               None, {"rtol": 1e-3, "atol": 1e-5}, 0, Deviation(9, "loss", 0.25, 0.5, 0.25), Rebased(8, fp(8)))
    ledger.identity.record_topology_change(resharded)
    snapshot(run_dir, ledger, 4)
    ledger.retention.prune(2, ArchiveEntry("steps_0000000001-0000000002.parquet", 1, 2, 8, 100, "d" * 64))
    meta = ledger.identity.all()
    assert [list(e) for e in meta["lineage"]] == [
        ["kind", "at_step", "time"],
        ["kind", "at_step", "snapshot_step", "config_changes", "world_size", "time", "versions", "resume_from", "versions_changed"]]
    assert meta["config_history"] == [{"from_step": 7, "config": cfg}] and list(meta["config_history"][0]) == ["from_step", "config"]
    assert meta["topology_history"][0] == {"from_step": 7, "topology": one, "from": two, "snapshot_step": 4, "resharded": None,
                                           "replayed": [5, 6], "tolerance": {"rtol": 1e-3, "atol": 1e-5}, "checked_steps": 2,
                                           "max_deviation": None, "rebased": {"step": 6, "fingerprint": fp(6)}}
    assert list(meta["topology_history"][0]) == ["from_step", "topology", "from", "snapshot_step", "resharded", "replayed", "tolerance",
                                                 "checked_steps", "max_deviation", "rebased"]
    # a resharded snapshot and the largest deviation: the maps checkpointer.Resharded and asdict(recovery.Deviation) wrote
    assert packb(meta["topology_history"][1]) == packb({
        "from_step": 9, "topology": one, "from": one, "snapshot_step": 8, "resharded": {"from": two, "to": one, "convert_s": 0.5, "cached": False},
        "replayed": None, "tolerance": {"rtol": 1e-3, "atol": 1e-5}, "checked_steps": 0,
        "max_deviation": {"step": 9, "metric": "loss", "replayed": 0.25, "journaled": 0.5, "deviation": 0.25},
        "rebased": {"step": 8, "fingerprint": fp(8)}})
    assert list(change.control_details()) == ["from", "to", "snapshot_step", "resharded", "replayed", "tolerance", "checked_steps",
                                              "max_deviation", "rebased"]
    assert list(ledger.journal.meta.snapshots()[4]) == ["path", "fingerprint", "manifest", "time"]
    assert meta["archive"] == [{"file": "steps_0000000001-0000000002.parquet", "first": 1, "last": 2, "rows": 8, "bytes": 100,
                                "digest": "d" * 64}]
    assert list(meta["archive"][0]) == ["file", "first", "last", "rows", "bytes", "digest"]
    assert ledger.history().topology_changes == [change, resharded] and ledger.topology_at(7) == Topology(**one)
    assert ledger.topology_at(6).world_size == 2


def test_manifest_and_snapshot_meta_keep_their_files_as_they_were(tmp_path):
    """manifest.json and meta.json through their types: the maps of the previous release, key for key
    and in order; a manifest that is not well formed reads as none; a meta.json from before a field
    reads with its default."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"x" * 10)
    (tmp_path / "meta.json").write_text("{}")
    m = Manifest.of(tmp_path)
    stored = json.loads(json.dumps(m.to_dict()))
    assert list(stored) == ["version", "hash", "files"] and list(stored["files"]) == ["a/w.bin", "meta.json"]
    assert list(stored["files"]["a/w.bin"]) == ["size", "blake3"] and stored["files"]["a/w.bin"]["size"] == 10
    assert Manifest.parse(stored) == m
    for bad in ({**stored, "version": 2}, {"version": 1, "hash": "blake3"}, [stored],
                {**stored, "files": {"../x": stored["files"]["a/w.bin"]}},
                {**stored, "files": {"a/w.bin": {**stored["files"]["a/w.bin"], "extra": 1}}},
                {**stored, "files": {"a/w.bin": {"size": -1, "blake3": "0" * 64}}}):
        assert Manifest.parse(bad) is None
    meta = SnapshotMeta(step=3, fingerprint=fp(3), config_hash="h", engines=["actor"], world_size=2, tensor_parallel_size=1,
                        zero_stage=1, time=1.0, python="3.12.0")
    assert list(meta.to_dict()) == ["version", "step", "fingerprint", "config_hash", "engines", "world_size", "tensor_parallel_size",
                                    "zero_stage", "time", "python"]
    assert SnapshotMeta.from_dict(meta.to_dict()) == meta and meta.topology == Topology(2, 1, 1)
    old = SnapshotMeta.from_dict({"version": 1, "step": 3, "fingerprint": fp(3), "engines": ["actor"], "world_size": 2,
                                  "tensor_parallel_size": 1})
    assert old.topology == Topology(2, 1, 0) and old.python is None


def test_metrics_and_fingerprints_come_from_the_summaries(run):
    _run_dir, ledger = run
    assert [s for s, _ in ledger.metrics(2, 4)] == [2, 3, 4]
    assert dict(ledger.metrics())[5] == {"loss": 0.5}
    assert ledger.fingerprints() == {s: fp(s) for s in range(1, 7)} and ledger.fingerprint_at(3) == fp(3)


# ----------------------------------------------------------------------------- the snapshot store


def test_latest_as_a_directory_after_a_copy_that_follows_links_is_replaced_by_the_link(run):
    """`cp -rL` of a run turns `latest` (and a `.latest.tmp` a kill left) into copies of a snapshot:
    the next publish still points `latest` at the newest snapshot, and the snapshots stay whole."""
    run_dir, ledger = run
    snapshot(run_dir, ledger, 2)
    for name in ("latest", ".latest.tmp"):
        link = run_dir / name
        if link.is_symlink():
            link.unlink()
        shutil.copytree(run_dir / "step_00002", link)
    snapshot(run_dir, ledger, 4)
    assert os.readlink(run_dir / "latest") == "step_00004" and not (run_dir / ".latest.tmp").exists()
    assert sorted(ledger.snapshots.index()) == [2, 4] and (run_dir / "step_00002" / "weights.bin").read_bytes() == bytes([2]) * 64


def test_rotation_keeps_the_newest_and_latest_follows(run):
    run_dir, ledger = run
    for s in (2, 4, 6):
        snapshot(run_dir, ledger, s)
    SnapshotStore(run_dir, ledger).rotate(2)
    assert sorted(ledger.snapshots.index()) == [4, 6]
    assert not (run_dir / "step_00002").exists() and os.readlink(run_dir / "latest") == "step_00006"
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".trash-")]


def test_quarantine_moves_out_of_the_index_and_the_way(run):
    run_dir, ledger = run
    for s in (4, 6):
        snapshot(run_dir, ledger, s)
    dest = SnapshotStore(run_dir, ledger).quarantine(6, run_dir / "step_00006", "a test's reason")
    assert dest == run_dir / "quarantine" / "step_00006" and (dest / META).is_file()
    assert sorted(ledger.snapshots.index()) == [4] and os.readlink(run_dir / "latest") == "step_00004"
    assert ledger.snapshots.quarantined()[-1]["reason"] == "a test's reason"


def test_a_resume_adopts_what_checks_out_and_sets_aside_the_rest_never_deleting(run):
    run_dir, ledger = run
    snapshot(run_dir, ledger, 2)
    snapshot(run_dir, ledger, 4, publish=False)  # valid, and step 4 is in the journal: adopted
    snapshot(run_dir, ledger, 5, fingerprint=fp(99), publish=False)  # not the journal's state at step 5
    snapshot(run_dir, ledger, 8, publish=False)  # its step was lost (the journal ends at 6)
    (run_dir / ".tmp-step_00009").mkdir()
    lines = [item.done for item in SnapshotStore(run_dir, ledger).recover_leftovers()]
    assert "Removed what an interrupted run left behind: .tmp-step_00009" in lines
    assert any(line.startswith("Adopted step_00004") for line in lines)
    assert sorted(ledger.snapshots.index()) == [2, 4] and os.readlink(run_dir / "latest") == "step_00004"
    assert {q["name"]: q["reason"] for q in ledger.snapshots.quarantined()} == {
        "step_00005": "published but not indexed, and its fingerprint does not match the journal's for step 5",
        "step_00008": "published but not indexed, and step 8 is not in the journal (it ends at step 6)",
    }
    assert (run_dir / "quarantine" / "step_00008" / "weights.bin").is_file()


def test_rotation_counts_only_snapshots_on_disk_and_whole(run):
    """save_total_limit=2 with step_00002 deleted by hand and step_00003's manifest rewritten: neither
    is counted nor deleted, so the good step_00001 stays until two good newer ones exist."""
    run_dir, ledger = run
    for s in (1, 2, 3):
        snapshot(run_dir, ledger, s)
    shutil.rmtree(run_dir / "step_00002")
    (run_dir / "step_00003" / "manifest.json").write_text("{}")
    store = SnapshotStore(run_dir, ledger)
    assert list(store.sound()) == [1]
    store.rotate(2)
    assert sorted(ledger.snapshots.index()) == [1, 2, 3] and (run_dir / "step_00001").is_dir() and (run_dir / "step_00003").is_dir()
    snapshot(run_dir, ledger, 5)
    store.rotate(2)  # the checkpointer rotates after each publish
    assert sorted(ledger.snapshots.index()) == [1, 2, 3, 5] and (run_dir / "step_00001").is_dir()
    snapshot(run_dir, ledger, 6)
    store.rotate(2)  # two good newer ones: now the oldest good one goes
    assert sorted(ledger.snapshots.index()) == [2, 3, 5, 6] and not (run_dir / "step_00001").exists()
    assert (run_dir / "step_00003").is_dir()  # the one that fails its check is left for a resume to quarantine


@pytest.mark.parametrize("gone, bound", [((), 2), ((2,), 4), ((2, 4), 0)])
def test_retention_prunes_only_against_a_snapshot_on_disk_and_whole(run, gone, bound):
    run_dir, ledger = run
    for s in (2, 4):
        snapshot(run_dir, ledger, s)
    for s in gone:
        shutil.rmtree(run_dir / f"step_{s:05d}")
    cfg = make_config(None, ["trainer.total_steps=6", "journal.retain_samples=since_oldest_snapshot"])
    apply_retention(run_dir, cfg, ledger, Said())
    assert ledger.retention.pruned_through() == bound  # step 4 deleted by hand never lets steps 1-4 go while step_00002 is all there is


def test_verify_and_resume_share_one_plan_for_leftovers(run):
    """plan_leftovers is what verify prints; recover_leftovers carries out exactly that plan."""
    run_dir, ledger = run
    for s in (2, 3):
        snapshot(run_dir, ledger, s)
    snapshot(run_dir, ledger, 4, publish=False)  # adopted
    shutil.copytree(run_dir / "step_00004", run_dir / "step_00005")  # meta says step 4: quarantined
    shutil.rmtree(run_dir / "step_00003")  # deleted by hand: unindexed
    (run_dir / ".trash-step_00001-77").mkdir()  # removed
    store = SnapshotStore(run_dir, ledger)
    plan = store.plan_leftovers()
    assert [(x.name, x.action) for x in plan] == [(".trash-step_00001-77", REMOVE), ("step_00004", ADOPT),
                                                  ("step_00005", QUARANTINE), ("step_00003", UNINDEX)]
    assert plan[-1].plan == ("step_00003 is in the index but not on disk (deleted by hand?): the next --resume removes it from the "
                            "index; it is never counted, rotated against or pruned against")
    refused = store.plan_leftovers(refused="the journal is damaged")
    assert {(x.name, x.action) for x in refused} == {(".trash-step_00001-77", KEEP), ("step_00004", KEEP), ("step_00005", KEEP)}
    done = store.recover_leftovers()
    assert [(x.name, x.action) for x in done] == [(x.name, x.action) for x in plan]
    assert [x.done for x in done if x.warning] == ["step_00003 is in the index but not on disk (deleted by hand?): removed from the index"]
    assert sorted(ledger.snapshots.index()) == [2, 4] and os.readlink(run_dir / "latest") == "step_00004"
    assert [(m["name"], m["step"]) for m in ledger.snapshots.missing()] == [("step_00003", 3)]
    assert (run_dir / "quarantine" / "step_00005").is_dir() and not (run_dir / ".trash-step_00001-77").exists()
    assert store.plan_leftovers() == []


# ----------------------------------------------------------------------------- retention and the schedule


@pytest.mark.parametrize("policy, snaps, last, bound", [
    ("all", [4, 6], 6, 0),
    ("since_oldest_snapshot", [], 6, 0),
    ("since_oldest_snapshot", [4, 6], 6, 4),
    ("3", [4, 6], 6, 3),  # the last 3 steps keep their samples too
    ("10", [4, 6], 6, 0),
])
def test_the_retention_bound(policy, snaps, last, bound):
    assert prune_bound(policy, snaps, last) == bound


def test_the_checkpoint_schedule_resumes_deciding_the_same():
    cfg = make_config(None, ["trainer.save_interval=3", "trainer.checkpoint_policy=verlj.engine.loop.policy.SaveOnRewardDrop",
                             "trainer.checkpoint_policy_kwargs={drop: 0.5}"]).trainer
    a = CheckpointSchedule(cfg)
    rewards = [1.0, 1.0, 0.4, 0.4, 0.1, 0.1]
    due = [a.observe(s, {"critic/score/mean": r}, {}) for s, r in enumerate(rewards, 1)]
    assert due == [False, False, True, False, True, True]  # a drop of more than half, and every third step
    b = CheckpointSchedule(cfg)
    b.load_state_dict(a.state_dict())
    assert b.observe(7, {"critic/score/mean": 0.01}, {}) == a.observe(7, {"critic/score/mean": 0.01}, {})
    with pytest.raises(SnapshotError, match="checkpoint schedule state has version 99; this verlj reads version 1"):
        b.load_state_dict({**a.state_dict(), "version": 99})
    old = make_config(None, ["trainer.checkpoint_policy=verlj.engine.state.policy.SaveOnRewardDrop"]).trainer
    assert CheckpointSchedule(old).policy is not None  # the path runs made before the move stored still resolves


# ----------------------------------------------------------------------------- recovery's choice


def test_the_newest_valid_snapshot_at_or_before_the_limit_is_chosen(run):
    run_dir, ledger = run
    for s in (2, 4, 6):
        snapshot(run_dir, ledger, s)
    said = Said()
    assert choose_snapshot(run_dir, ledger, 6, said)[0] == 6
    assert choose_snapshot(run_dir, ledger, 5, said)[0] == 4
    (run_dir / "step_00004" / "weights.bin").write_bytes(b"\0" * 64)  # damaged: same size, other bytes
    store = SnapshotStore(run_dir, ledger)
    assert choose_snapshot(run_dir, ledger, 5, said, store=store)[0] == 2
    assert "Skipping damaged snapshot" in said.lines[-1] and (run_dir / "quarantine" / "step_00004").is_dir()
    assert choose_snapshot(run_dir, ledger, 1, said) == (0, None)  # nothing usable: the initial state


def mirrored(mirror: Mirror, step: int, fingerprint=None) -> Path:
    """A mirror of `step` written as the checkpointer writes one (a snapshot's files in its tmp dir), then published."""
    tmp = mirror.tmp_dir(step)
    tmp.mkdir(parents=True)
    (tmp / META).write_text(json.dumps({"step": step, "fingerprint": fingerprint or fp(step), "time": 1.0}))
    (tmp / ANCHOR).write_bytes(packb({"sampler": {"cursor": step, "epoch": 0}, "buffer": {"samples": {"id": []}}}))
    (tmp / "weights.bin").write_bytes(bytes([step]) * 64)
    return mirror.publish(step, tmp)


def test_a_mirror_keeps_two_slots_and_drops_what_a_later_timeline_left(tmp_path):
    root = mirror_root(tmp_path / "run", str(tmp_path / "shm"))
    assert root.parent == tmp_path / "shm" and root == mirror_root(tmp_path / "." / "run", str(tmp_path / "shm"))  # by its path
    assert root != mirror_root(tmp_path / "other", str(tmp_path / "shm"))
    mirror = Mirror(root, 2)
    assert [s for s in range(1, 7) if mirror.due(s)] == [2, 4, 6] and not Mirror(root, 0).due(4)
    assert mirror.steps() == [] and mirror.candidates(10) == []
    for s in (2, 4, 6):
        mirrored(mirror, s)
    assert mirror.steps() == [4, 6] and mirror.last_bytes == sum(p.stat().st_size for p in (root / "step_00006").iterdir())
    assert [s for s, _ in mirror.candidates(5)] == [4]
    mirror.tmp_dir(8).mkdir()  # killed mid-copy: never a candidate, removed by the next publish
    assert mirror.steps() == [4, 6]
    mirrored(mirror, 5)  # a restart went back to step 4: the mirror of step 6 is another timeline's
    assert mirror.steps() == [4, 5] and sorted(p.name for p in root.iterdir()) == ["step_00004", "step_00005"]
    assert mirror.room(1)[0] and not mirror.room(1 << 62)[0]
    assert Mirror(tmp_path / "not" / "yet" / "made", 1).room(1)[0]  # another rank's view before rank 0 made the directory
    mirror.clear()
    assert not root.exists() and mirror.steps() == []


def test_a_resume_takes_the_newest_valid_of_mirrors_and_snapshots_a_mirror_first(run, tmp_path):
    run_dir, ledger = run
    for s in (2, 4):
        snapshot(run_dir, ledger, s)
    mirror = Mirror(tmp_path / "shm" / "m", 1)
    for s in (3, 4, 5):
        mirrored(mirror, s)  # 4 and 5 kept
    said = Said()
    assert choose_snapshot(run_dir, ledger, 6, said, mirror=mirror) == (5, mirror.root / "step_00005")
    assert choose_snapshot(run_dir, ledger, 4, said, mirror=mirror) == (4, mirror.root / "step_00004")  # before the snapshot of 4
    assert choose_snapshot(run_dir, ledger, 6, said) == (4, run_dir / "step_00004")  # verify and replay: no mirror
    (mirror.root / "step_00005" / "weights.bin").write_bytes(b"\0" * 64)
    store = SnapshotStore(run_dir, ledger)
    assert choose_snapshot(run_dir, ledger, 6, said, store=store, mirror=mirror) == (4, mirror.root / "step_00004")
    assert said.lines[-1] == (f"Skipping the memory mirror of step 5 ({mirror.root / 'step_00005'}): weights.bin fails its checksum")
    assert (mirror.root / "step_00005").is_dir() and not (run_dir / "quarantine").exists()  # skipped, never quarantined
    mirrored(mirror, 6, fingerprint=fp(1))  # a mirror whose state is not the journal's step 6 (the damaged 5 kept beside it)
    said = Said()
    assert choose_snapshot(run_dir, ledger, 6, said, mirror=mirror) == (4, run_dir / "step_00004")
    assert [line.partition(": ")[2] for line in said.lines] == ["its fingerprint does not match the journal's for step 6",
                                                                "weights.bin fails its checksum"]


def test_pruned_samples_bound_where_a_replay_may_start(run):
    run_dir, ledger = run
    for s in (2, 4):
        snapshot(run_dir, ledger, s)
    ledger.retention.prune(4)
    assert choose_snapshot(run_dir, ledger, 6, Said())[0] == 4
    with pytest.raises(ReplayError, match=r"no snapshot at or before step 3 can be used to reach step 6: .*through 4.* \(kept: step_00004\)"):
        choose_snapshot(run_dir, ledger, 3, Said(), target=6)
    (run_dir / "step_00004" / META).write_text("{}")
    with pytest.raises(ReplayError, match="no valid one is kept from there to step 6"):
        choose_snapshot(run_dir, ledger, 6, Said())


def test_an_explicit_snapshot_must_be_this_runs_and_indexed(run, tmp_path_factory):
    run_dir, ledger = run
    snapshot(run_dir, ledger, 2)
    assert resolve_explicit(run_dir, ledger, "step_00002") == (2, run_dir / "step_00002")
    other = tmp_path_factory.mktemp("other")
    (other / "step_00002").mkdir()
    with pytest.raises(SnapshotError, match="is not a snapshot of the run in"):
        resolve_explicit(run_dir, ledger, str(other / "step_00002"))
    (run_dir / "step_00003").mkdir()
    with pytest.raises(SnapshotError, match="not in this run's snapshot index"):
        resolve_explicit(run_dir, ledger, "step_00003")


def test_an_agent_groups_calls_are_kept_one_key_a_call_and_read_back_in_order(run):
    import numpy as np

    from verlj.engine.schema.agent_calls import AgentCalls, Call
    from verlj.engine.schema.sample import GroupInFlight

    _, ledger = run
    writes = []
    put = ledger.journal.pending.put
    ledger.journal.pending.put = lambda values, *a: (writes.append(len(values)), put(values, *a))[1]

    def call(i):
        return Call(f'{{"i":{i}}}', f"d{i}", np.arange(4 + i), np.arange(i % 3 + 1), np.full(i % 3 + 1, -0.25 * i, np.float32), f"réponse {i}".encode())

    def entry(g):
        empty = [np.zeros(0)] * 2
        return GroupInFlight(g, 3, [1], empty, empty, empty, empty, empty, empty, [11, 12], [0, 0], ["", ""])

    ledger.in_flight.write_in_flight([entry(5)], [], [(5, 0, 0, call(0).to_dict()), (5, 1, 0, call(100).to_dict())])
    for k in range(1, 10):  # each write adds its call alone: linear in the episode's length
        ledger.in_flight.write_in_flight([], [], [(5, 0, k, call(k).to_dict())])
    assert writes == [3] + [1] * 9
    back = ledger.in_flight.groups()[5]
    got = [AgentCalls.from_json(text).calls for text in back.agent_calls]
    assert [c.response for c in got[0]] == [call(k).response for k in range(10)] and got[1][0].request == call(100).request
    assert all(np.array_equal(a.logprobs, call(k).logprobs) and a.logprobs.dtype == np.float32 for k, a in enumerate(got[0]))
    assert (back.row, back.env_seed) == (3, [11, 12])
    ledger.in_flight.write_in_flight([], [], dropped=[(5, 0, k) for k in range(4, 10)])  # a divergence at call 4 discarded the rest
    assert len(AgentCalls.from_json(ledger.in_flight.groups()[5].agent_calls[0]).calls) == 4
    ledger.in_flight.write_in_flight([entry(6)], [5], [(6, 1, 0, call(7).to_dict())])  # group 5 in a committed step: it and its calls forgotten
    assert list(ledger.in_flight.groups()) == [6] and ledger.in_flight.groups()[6].agent_calls[0] == ""
    assert not [k for k in ledger.journal.pending.entries() if k.startswith(b"agentcalls/") and k[11:19] == (5).to_bytes(8, "big")]


def test_tool_calls_are_kept_beside_model_calls_forgotten_with_their_group_and_carried_through_a_fresh_start(run, tmp_path):
    """rollout.tools: a tool call's entry (its key a model call's and one byte) read back with its group's calls (completion
    order) or by its episode's id (step order, the id as group, episode 0); forgotten with its group; what an unstarted
    journal held of them, and its run token, carried into the journal that replaces it."""
    import numpy as np

    from verlj.engine.loop.ledger.identity import RUN_TOKEN
    from verlj.engine.loop.ledger.in_flight import carry_tools, unstarted_tools
    from verlj.engine.schema.agent_calls import AgentCalls, ToolCall
    from verlj.engine.schema.sample import GroupInFlight

    _, ledger = run
    empty = [np.zeros(0)] * 2
    sent = ToolCall("open", '{"t":1}', "d", "verlj-x-e5-t0", "external", 1)
    done = ToolCall("open", '{"t":1}', "d", "verlj-x-e5-t0", "external", 1, "done", "opened")
    ledger.in_flight.write_in_flight([GroupInFlight(5, 3, [1], empty, empty, empty, empty, empty, empty, [11, 12], [0, 0], ["", ""])], [],
                                     tools=[(5, 1, 0, sent.to_dict())])
    assert AgentCalls.from_json(ledger.in_flight.groups()[5].agent_calls[1]).tools == (sent,)  # no model call yet: the tool's alone
    ledger.in_flight.write_in_flight([], [], tools=[(5, 1, 0, done.to_dict()), (40, 0, 0, sent.to_dict()), (40, 0, 1, done.to_dict())])
    assert AgentCalls.from_json(ledger.in_flight.groups()[5].agent_calls[1]).tools == (done,)  # the call done replaces it as sent
    assert ledger.in_flight.tool_calls() == {40: [sent, done]}  # step order's: by the episode's id (no group entry)
    ledger.in_flight.write_in_flight([], [], dropped_tools=[(40, 0, 1)])  # a divergence at call 1
    assert ledger.in_flight.tool_calls() == {40: [sent]}
    ledger.journal.meta.update({RUN_TOKEN: "tok"})
    kept = unstarted_tools(ledger.journal)
    assert kept is not None and kept.token == "tok" and len(kept.entries) == 3  # both tool entries and group 5's own entry
    fresh = Journal.open_writer(tmp_path / "fresh")
    try:
        said = carry_tools(fresh, kept)
        assert said and said[0].startswith("rollout.tools: the 2 tool call(s) in flight of the start that never committed a step are kept")
        assert carry_tools(fresh, None) == []
        assert fresh.meta.get(RUN_TOKEN) == "tok" and Ledger(fresh).in_flight.tool_calls() == {40: [sent]}
        assert 5 in Ledger(fresh).in_flight.groups()
    finally:
        fresh.close()
    ledger.in_flight.write_in_flight([], [5, 40])  # in a committed step: forgotten with the groups' calls
    assert ledger.in_flight.groups() == {} and ledger.in_flight.tool_calls() == {}
    assert unstarted_tools(ledger.journal) is None


def test_step_order_forgets_a_steps_tool_calls_once_it_has_committed():
    """sources.agent_players.StepTools: at a round of step t, the tool calls of steps up to t-1 forgotten (sync), up to t-2 in
    async step order (its round plays while the step before it updates); a process's first round reads what an earlier one
    made durable, keeps those of its episodes and forgets those of steps before it."""
    from verlj.engine.rl.sources.agent_players import StepTools
    from verlj.engine.schema.agent_calls import ToolCall

    class Log:
        def __init__(self, held):
            self.held, self.forgot = held, []

        def run_token(self):
            return "tok"

        def read_tools(self):
            return {g: [c.to_dict() for c in calls] for g, calls in self.held.items()}

        def keep_in_flight(self, groups, settled, *a, **kw):
            self.forgot.append(sorted(settled))

    call = ToolCall("open", "{}", "d", "k", "external", 1, "done", "x")
    for sync, lag in ((True, 1), (False, 2)):
        log, tools = Log({3: [call], 20: [call], 21: [call]}), StepTools(sync)
        got = tools.round(log, 5, [20, 21, 22])  # the process's first round: step 5 asked again under the ids it had
        assert got == {20: [call], 21: [call]} and log.forgot == [[3]] and tools.token == "tok"  # episode 3: an earlier step's
        assert tools.round(log, 5, [23]) == {} and log.forgot == [[3]]  # another round of step 5: nothing to forget yet
        tools.round(log, 6, [30])
        tools.round(log, 7, [40])
        assert log.forgot == [[3], [20, 21, 22, 23]] + ([[30]] if lag == 1 else []), (sync, log.forgot)
