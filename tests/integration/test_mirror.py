"""trainer.mirror_interval: the state after recent committed steps held in memory (loop/mirror.py), which a restart
loads instead of a snapshot from disk. Each run here is killed (SIGKILL, at a failpoint) and restarted by its
supervisor (trainer.max_restarts) or resumed by hand, and must end bit-identical to the uninterrupted run: the
same journaled events and fingerprints. The mirrors go to a directory of the test's (trainer.mirror_dir), not
the machine's /dev/shm.

    python -m pytest -n 0 tests/integration/test_mirror.py
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from verlj_testing import TINY, assert_same_journal, fingerprints, train

MIRRORED = ["trainer.mirror_interval=1", "trainer.save_interval=0"]  # no snapshot on disk but the final one: every restart is the mirror's


@pytest.fixture(scope="module")
def reference(tmp_path_factory, reference_run) -> Path:
    return reference_run(tmp_path_factory.mktemp("mirror") / "reference", TINY, {})


def mirrors(shm: Path) -> list[str]:
    """What the mirror directory holds: each run's directory of mirrors, and what is in it."""
    return sorted(f"{d.name[:13]}/{p.name}" for d in shm.iterdir() for p in d.iterdir()) if shm.is_dir() else []


def said(out) -> str:
    return out.stdout + out.stderr


@pytest.mark.parametrize("kill, loaded, replayed", [
    ("snapshot.mid_write:1", 3, r"Replayed step 4 from the journal\."),  # killed writing the final snapshot, after step 4
    ("mirror.mid_write:3", 2, r"Replayed steps? 3(–4)? from the journal\."),  # killed writing step 3's mirror: step 2's is whole
    # (the update of step 4 waits only for step 3's tensors to be copied: under load it may commit before the kill)
], ids=["final-snapshot", "mid-copy"])
def test_a_restart_loads_the_newest_whole_mirror_and_ends_identical(tmp_path, reference, kill, loaded, replayed):
    run, shm = tmp_path / "run", tmp_path / "shm"
    out = train(run, *MIRRORED, f"trainer.mirror_dir={shm}", "trainer.max_restarts=1", VERLJ_FAILPOINT=kill)
    assert out.returncode == 0, said(out)[-3000:]
    assert "the training process was killed by SIGKILL; restarting it with --resume (1 of 1)" in said(out)
    assert f"/step_{loaded:05d} (the memory mirror of step {loaded})" in said(out), said(out)[-3000:]
    assert re.search(replayed, said(out)), said(out)[-3000:]
    assert fingerprints(run) == fingerprints(reference)
    assert_same_journal(reference, run)
    assert mirrors(shm) == []  # the run finished, its final snapshot on disk: its mirrors are gone
    assert re.search(r"\[INFO\] Step 2: mirroring the state after every 1 step\(s\) into \S+ \([\d,.]+ MiB a mirror, two held in memory\)",
                     said(out)), said(out)[-3000:]  # the first mirror's bytes, said once it is published


def test_a_damaged_mirror_is_skipped_in_one_line_for_the_one_before_it(tmp_path, reference):
    run, shm = tmp_path / "run", tmp_path / "shm"
    over = [*MIRRORED, f"trainer.mirror_dir={shm}"]
    out = train(run, *over, VERLJ_FAILPOINT="snapshot.mid_write:1")  # the final snapshot's, after step 4: mirror 3 joined before it
    assert out.returncode == -9, said(out)[-3000:]
    held = mirrors(shm)
    assert [h.rpartition("/")[2] for h in held] == ["step_00002", "step_00003"], held  # two slots
    root = next(shm.iterdir())
    weights = max((p for p in (root / "step_00003").rglob("*.pt")), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    out = train(run, *over, resume=True)
    assert out.returncode == 0, said(out)[-3000:]
    assert f"Skipping the memory mirror of step 3 ({root / 'step_00003'}): {weights.relative_to(root / 'step_00003')} fails its checksum" \
        in said(out), said(out)[-3000:]
    assert "(the memory mirror of step 2)" in said(out) and "Replayed steps 3–4 from the journal." in said(out)
    assert fingerprints(run) == fingerprints(reference)
    assert_same_journal(reference, run)


def test_without_room_for_a_mirror_the_run_says_so_once_and_trains_without(tmp_path, reference):
    """A mirror directory that cannot be made (under a file): one line, and the run goes on as without mirrors."""
    (tmp_path / "file").write_text("")
    run = tmp_path / "run"
    out = train(run, *MIRRORED, f"trainer.mirror_dir={tmp_path / 'file' / 'shm'}")
    assert out.returncode == 0, said(out)[-3000:]
    lines = [ln for ln in said(out).splitlines() if "trainer.mirror_interval" in ln]
    assert len(lines) == 1 and "not mirroring the state after step 1 or later" in lines[0], lines
    assert fingerprints(run) == fingerprints(reference)


def test_a_mirror_directory_that_fills_up_stops_the_mirroring_in_one_line_and_the_run_ends_identical(tmp_path, reference):
    """A full /dev/shm, in small: trainer.mirror_dir on a 2600 KiB tmpfs, room for two of this job's mirrors (1.0 MiB each;
    the first checked against 16 bytes a parameter, 1.4 MiB) and not for a third beside them. Mirrors 1 and 2 are written;
    the room check before mirror 3 reads the filesystem's free space, says so once, the two are removed, and the run trains
    on without mirrors to the uninterrupted run's state."""
    shm = tmp_path / "shm"
    shm.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(shm)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"a full disk needs a small tmpfs, which needs root (CI runs as root): {mounted.stderr.strip()}"
    try:
        run = tmp_path / "run"
        out = train(run, *MIRRORED, f"trainer.mirror_dir={shm}")
        assert out.returncode == 0, said(out)[-3000:]
        assert "[INFO] Step 2: mirroring the state after every 1 step(s)" in said(out)  # mirror 2 published (1 before it)
        lines = [ln for ln in said(out).splitlines() if "trainer.mirror_interval" in ln]
        assert len(lines) == 1, lines
        assert re.search(r"not mirroring the state after step 3 or later: it needs about 1\.0 MiB and \S+ has 0\.\d MiB free", lines[0]), lines
        assert fingerprints(run) == fingerprints(reference)
        assert_same_journal(reference, run)
        assert mirrors(shm) == []
    finally:
        subprocess.run(["umount", "-l", str(shm)], capture_output=True)


def test_two_ranks_under_zero_3_mirror_their_shards_together_and_resume_from_them_identical(tmp_path):
    """torchrun, two ranks on this machine, ZeRO-3: each rank writes its shards into the one mirror, rank 0 publishes
    it once both are written; killed writing the final snapshot (every rank), resumed from the mirror of step 3."""
    over = ["trainer.total_steps=4", "distributed.zero_stage=3", "rollout.n=2"]
    ref, run, shm = tmp_path / "ref", tmp_path / "run", tmp_path / "shm"
    out = train(ref, *over, ranks=2)
    assert out.returncode == 0, said(out)[-3000:]
    mirrored = [*over, *MIRRORED, f"trainer.mirror_dir={shm}"]
    out = train(run, *mirrored, ranks=2, VERLJ_FAILPOINT="snapshot.mid_write:1")
    assert out.returncode != 0 and max(fingerprints(run)) == 4, said(out)[-3000:]
    assert "not mirroring" not in said(out), said(out)[-3000:]  # (rank 1 once found no mirror directory yet, made by rank 0)
    root = next(shm.iterdir())
    assert {p.name for p in (root / "step_00003").rglob("*optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}  # each rank's shard
    out = train(run, *mirrored, ranks=2, resume=True)
    assert out.returncode == 0, said(out)[-3000:]
    assert "(the memory mirror of step 3)" in said(out) and "Replayed step 4 from the journal." in said(out)
    assert fingerprints(run) == fingerprints(ref)
    assert_same_journal(ref, run)

    # rank 1's copy of step 2's mirror fails: rank 0 stops waiting for it, the mirroring stops in one line, the run goes on
    failed = tmp_path / "failed"
    out = train(failed, *mirrored, ranks=2, VERLJ_FAILPOINT="mirror.mid_write:2:fail-rank1")
    assert out.returncode == 0, said(out)[-3000:]
    lines = [ln for ln in said(out).splitlines() if "not mirroring" in ln]
    assert len(lines) == 1 and "not mirroring the state after step 3 or later" in lines[0], lines
    assert fingerprints(failed) == fingerprints(ref)
    assert_same_journal(ref, failed)


def test_a_restart_on_a_machine_without_the_mirror_says_so_and_replays_from_disk_identical(tmp_path, reference):
    run, shm = tmp_path / "run", tmp_path / "shm"
    over = [*MIRRORED, f"trainer.mirror_dir={shm}"]
    out = train(run, *over, VERLJ_FAILPOINT="snapshot.mid_write:1")
    assert out.returncode == -9 and len(mirrors(shm)) == 2, said(out)[-3000:]
    root = next(shm.iterdir())
    shutil.rmtree(shm)  # the node was lost: the restart runs on another machine, whose memory holds no mirror
    out = train(run, *over, resume=True)
    assert out.returncode == 0, said(out)[-3000:]
    assert f"No memory mirror of this run in {root} is newer than the initial state: starting from it" in said(out)
    assert "Replayed steps 1–4 from the journal." in said(out)
    assert fingerprints(run) == fingerprints(reference)
    assert_same_journal(reference, run)


def test_a_mirror_that_loads_as_another_state_is_removed_and_the_resume_says_so_then_goes_on_identical(tmp_path, reference):
    """The mirror of step 3 holding step 2's tensors under step 3's meta and a manifest that matches them: it passes
    every check before loading and loads as another state. Removed, said; nothing older on disk to load over it, so this
    resume stops in one line; the next takes the mirror of step 2."""
    from verlj.engine.state.manifest import MANIFEST, META, build_manifest

    run, shm = tmp_path / "run", tmp_path / "shm"
    over = [*MIRRORED, f"trainer.mirror_dir={shm}"]
    out = train(run, *over, VERLJ_FAILPOINT="snapshot.mid_write:1")
    assert out.returncode == -9, said(out)[-3000:]
    root = next(shm.iterdir())
    two, three = root / "step_00002", root / "step_00003"
    meta = (three / META).read_bytes()
    shutil.rmtree(three)
    shutil.copytree(two, three)
    (three / META).write_bytes(meta)
    (three / MANIFEST).write_text(json.dumps(build_manifest(three)))
    out = train(run, *over, resume=True)
    assert out.returncode == 1, said(out)[-3000:]
    assert f"state loaded from {three} has fingerprint" in said(out) and "removed it; loading from disk instead" in said(out)
    assert "no snapshot on disk is older: start the resume again" in said(out).strip().splitlines()[-1]
    assert not three.exists() and two.is_dir()
    out = train(run, *over, resume=True)
    assert out.returncode == 0, said(out)[-3000:]
    assert "(the memory mirror of step 2)" in said(out) and "Replayed steps 3–4 from the journal." in said(out)
    assert fingerprints(run) == fingerprints(reference)
    assert_same_journal(reference, run)
