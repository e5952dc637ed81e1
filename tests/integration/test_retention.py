"""Journal retention on real runs: pruning with save_total_limit, the Parquet archive, export, and
kill -9 while archiving and while pruning. Every comparison is against an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from verlj.engine.loop.run import train as run_train
from verlj.journal import open_journal_reader
from verlj_testing import REPO, TINY, _same, assert_same_journal, cli, comparable_steps, env, fingerprints, popen, train, verlj

SNAPS = ["trainer.save_interval=3", "trainer.save_total_limit=2"]
RETAIN = [*SNAPS, "journal.retain_samples=since_oldest_snapshot", "journal.archive=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retention")
    ref, pruned = root / "ref", root / "pruned"
    for run, extra in ((ref, SNAPS), (pruned, RETAIN)):  # uninterrupted runs, in this process: no interpreter to start
        assert run_train(run, None, [*TINY, "trainer.total_steps=9", *extra]).snapshots_failed is None  # as `verlj train` exits 0
    return root, ref, pruned


def journal_samples(run) -> dict[int, dict]:
    """sample id -> (step, its columns' values) straight from an unpruned journal."""
    out = {}
    with open_journal_reader(run / "journal") as j:
        for record in j.iter_steps():
            add = record.first("buffer.add")
            cols = add["samples"]
            for i, sid in enumerate(cols["id"].tolist()):
                out[sid] = {"step": record.step, "group": int(cols["group"][i]), "score": float(cols["score"][i]),
                            "response_ids": cols["response_ids"][i, : cols["response_ids_len"][i]].tolist(),
                            "gen_logprobs": cols["gen_logprobs"][i, : cols["gen_logprobs_len"][i]].tolist()}
    return out


def test_pruned_run_is_exact_verifies_and_post_mortem_reads_across_pruned_steps(runs):
    root, ref, pruned = runs
    assert fingerprints(pruned) == fingerprints(ref)
    with open_journal_reader(pruned / "journal") as j:
        assert j.retention.pruned_through() == 6  # snapshots 6 and 9 are kept: steps 1-6 are needed by neither
        assert [j.read_step(s).pruned for s in range(1, 10)] == [True] * 6 + [False] * 3
    v = cli("verify", pruned)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "samples of 6 steps through step 6 were pruned" in v.stdout and "Rollout archive: 2 files" in v.stdout
    for args in (("diff", ref, pruned), ("diff", ref, pruned, "--full")):
        d = verlj(*args)
        assert d.returncode == 0 and d.stdout.startswith("identical") and "not compared" not in d.stdout, d.stdout + d.stderr
    m = cli("metrics", pruned, "--names", "actor/pg_loss", "--steps", "1:9", "--csv", check=True)
    assert len(m.stdout.strip().splitlines()) == 10
    f = cli("find", pruned, "--where", "actor/pg_loss > -1000", "--json", check=True)
    assert [r["step"] for r in json.loads(f.stdout)] == list(range(1, 10))
    a = cli("inspect", pruned, "--step", "2", check=True).stdout
    b = cli("inspect", ref, "--step", "2", check=True).stdout
    assert "pruned from the journal (journal.retain_samples); shown from rollouts/" in a
    sample_lines = lambda text: [line for line in text.splitlines() if line.startswith("  ") and "|" in line]
    assert sample_lines(a) == sample_lines(b) and sample_lines(a)


def test_replay_into_pruned_steps_is_refused_in_one_line_and_writes_nothing(runs):
    root, ref, pruned = runs
    fork = root / "fork-refused"
    out = verlj("replay", pruned, "--to-step", "4", "--fork", fork)
    assert out.returncode == 1 and not fork.exists()
    assert out.stderr.strip().count("\n") == 0 and "pruned the samples of steps through 6" in out.stderr, out.stderr
    # step 4's own samples are gone: only a snapshot of step 4 could hold it (it said "from a snapshot at step 4 or
    # later, and no valid one is kept from there to step 4")
    assert "so only a snapshot taken at step 4 itself could hold its state, and none is kept" in out.stderr, out.stderr
    ok = verlj("replay", pruned, "--to-step", "8", "--json", check=True)  # from snapshot 6: needs only steps 7-8
    assert json.loads(ok.stdout.strip().splitlines()[-1])["fingerprint"] == fingerprints(ref)[8]


def test_export_round_trip_holds_exactly_the_journal_and_archive_samples(runs):
    pq = pytest.importorskip("pyarrow.parquet")
    root, ref, pruned = runs
    for run in (ref, pruned):
        cli("export", run, "--rollouts", "--output", root / f"{run.name}.parquet", check=True)
    cli("export", pruned, "--rollouts", "--output", root / "pruned.jsonl", check=True)
    a = pq.read_table(root / "ref.parquet").to_pylist()
    b = pq.read_table(root / "pruned.parquet").to_pylist()
    assert a == b  # the archive gives back what the journal held, column for column
    df = pytest.importorskip("pandas").read_parquet(root / "pruned.parquet")  # the table as its users read it
    assert len(df) == len(b) and list(df.columns) == list(b[0]) and (df["policy_version"] == df["step"] - 1).all()
    assert [json.loads(line) for line in (root / "pruned.jsonl").read_text().splitlines()] == b
    want = journal_samples(ref)
    assert sorted(r["sample_id"] for r in b) == sorted(want)
    for r in b:
        w = want[r["sample_id"]]
        assert (r["step"], r["group"], r["score"], r["response_ids"]) == (w["step"], w["group"], w["score"], w["response_ids"])
        assert np.array_equal(np.float32(r["gen_logprobs"]), np.float32(w["gen_logprobs"]))
        assert r["status"] == "consumed" and r["status_step"] == r["step"]  # GRPO consumes each step's samples
        assert r["response"] and r["prompt"]
    some = cli("export", pruned, "--rollouts", "--steps", "5:7", "--output", root / "some.jsonl", check=True)
    rows = [json.loads(line) for line in (root / "some.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {5, 6, 7} and f"wrote {len(rows)} samples" in some.stdout


@pytest.mark.parametrize("snapshot", [6, 9])
def test_resume_from_every_kept_snapshot_is_exact(runs, snapshot):
    root, ref, pruned = runs
    straight = root / "straight12"
    if not straight.exists():
        assert run_train(straight, None, [*TINY, "trainer.total_steps=12", *RETAIN]).snapshots_failed is None
    run = root / f"from{snapshot}"
    shutil.copytree(pruned, run, symlinks=True)
    out = train(run, "trainer.total_steps=12", *RETAIN, f"trainer.resume_from={snapshot}", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"step_{snapshot:05d}" in out.stdout
    assert_same_journal(run, straight)
    assert fingerprints(run) == fingerprints(straight)
    assert cli("verify", run).returncode == 0


@pytest.mark.parametrize("failpoint", ["archive.mid_write:2", "journal.prune:1"])
def test_kill_while_archiving_or_pruning_loses_nothing(runs, failpoint):
    pq = pytest.importorskip("pyarrow.parquet")
    root, ref, pruned = runs
    run = root / f"killed-{failpoint.split(':')[0]}"
    out = train(run, "trainer.total_steps=9", *RETAIN, VERLJ_FAILPOINT=failpoint)
    assert out.returncode == -9, out.stderr[-2000:]
    with open_journal_reader(run / "journal") as j:
        assert j.retention.pruned_through() == 0 and j.meta.get("archive") is None  # nothing half-done is visible
        assert not any(j.read_step(s).pruned for s in range(1, j.last_step() + 1))
    left = [p.name for p in (run / "rollouts").iterdir()]
    assert left, "the kill should have left the file it was writing"
    v = cli("verify", run)
    assert v.returncode == 0 and "left by an interrupted run" in v.stdout, v.stdout
    out = train(run, "trainer.total_steps=9", *RETAIN, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(run, pruned)
    assert fingerprints(run) == fingerprints(ref)
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == sorted(p.name for p in (pruned / "rollouts").iterdir())
    cli("export", run, "--rollouts", "--output", root / f"{run.name}.parquet", check=True)
    if not (root / "pruned-again.parquet").exists():  # the uninterrupted run's archive, exported once for both cases
        cli("export", pruned, "--rollouts", "--output", root / "pruned-again.parquet", check=True)
    assert pq.read_table(root / f"{run.name}.parquet").to_pylist() == pq.read_table(root / "pruned-again.parquet").to_pylist()
    assert cli("verify", run).returncode == 0


def test_diff_full_compares_pruned_steps_samples_from_the_archive(runs):
    """The pruned run's archived samples against the reference's journal, field by field; a changed
    token is a difference."""
    from verlj.engine.loop import archive
    from verlj.engine.loop.ledger import open_run
    from verlj.engine.post_mortem.diff import _same_samples, _step_samples

    root, ref, pruned = runs
    with open_run(ref) as la, open_run(pruned) as lb:
        reader = archive.Reader(pruned, lb)
        for step in (2, 5):
            a = _step_samples(la.journal.read_step(step), archive.Reader(ref, la))
            b = _step_samples(lb.journal.read_step(step), reader)
            assert lb.journal.read_step(step).pruned and len(b["sample_id"]) == len(a["sample_id"]) > 0
            assert _same_samples(a, b)
            values, offsets = b["response_ids"]
            changed = values.copy()
            changed[0] += 1
            assert not _same_samples(a, {**b, "response_ids": (changed, offsets)})


def test_archived_steps_without_pyarrow_and_exports_named_by_their_suffix(runs, tmp_path):
    root, ref, pruned = runs
    blocker = tmp_path / "block"
    (blocker / "pyarrow").mkdir(parents=True)
    (blocker / "pyarrow" / "__init__.py").write_text("raise ImportError('No module named pyarrow')\n")
    out = verlj("inspect", pruned, "--step", "2", PYTHONPATH=blocker)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == ("error: step 2's samples are in the rollout archive (rollouts/steps_0000000001-0000000003.parquet); "
                                  "reading it needs pyarrow: pip install 'verlj[archive]' (in a checkout: pip install -e '.[archive]')")
    some = verlj("export", pruned, "--rollouts", "--steps", "7:9", "--output", tmp_path / "late.jsonl", PYTHONPATH=blocker)
    assert some.returncode == 0 and len((tmp_path / "late.jsonl").read_text().splitlines()) > 0, some.stderr[-2000:]
    every = verlj("export", pruned, "--rollouts", "--output", tmp_path / "all.jsonl", PYTHONPATH=blocker)
    assert every.returncode == 1 and every.stderr.count("\n") == 1 and "needs pyarrow" in every.stderr
    assert not (tmp_path / "all.jsonl").exists()
    d = verlj("diff", ref, pruned, "--full", PYTHONPATH=blocker)  # the archive unreadable: said, not silently skipped
    assert d.returncode == 0 and d.stdout.startswith("identical"), d.stdout + d.stderr
    assert "; the samples of 6 pruned steps (1–6) were not compared: neither the journal nor the rollout archive holds them" in d.stdout
    csv = cli("export", pruned, "--rollouts", "--output", tmp_path / "out.csv")
    assert csv.returncode == 2 and "name the file .parquet or .jsonl" in csv.stderr and not (tmp_path / "out.csv").exists()


def test_a_resume_from_before_what_retention_kept_says_why_in_one_line(runs, tmp_path):
    root, ref, pruned = runs
    run = tmp_path / "run"
    shutil.copytree(pruned, run, symlinks=True)
    out = train(run, "trainer.total_steps=10", *RETAIN, "trainer.resume_from=3", resume=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("error: no snapshot at or before step 3 can be used to reach step 9: journal.retain_samples pruned "
                                  "the samples of steps through 6, so replay must start from a snapshot at step 6 or later "
                                  "(kept: step_00006, step_00009)")


def test_verify_of_a_pruned_run_whose_snapshots_are_all_deleted_says_it_cannot_resume(runs, tmp_path):
    """Nothing is damaged, but nothing can bring the run back: verify says so and exits 1, as resume refuses."""
    _root, _ref, pruned = runs
    run = tmp_path / "run"
    shutil.copytree(pruned, run, symlinks=True)
    for snap in run.glob("step_*"):
        shutil.rmtree(snap)
    out = cli("verify", run)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert "Resume is not possible: no valid snapshot is kept, and retention pruned the samples" in out.stdout, out.stdout
    assert out.stdout.strip().splitlines()[-1] == "NOT RESUMABLE: see the line above.", out.stdout
    assert "OK:" not in out.stdout
    assert train(run, "trainer.total_steps=10", *RETAIN, resume=True).returncode == 1  # the resume refuses as verify said


# ----------------------------------------------------------------------------- snapshots deleted by hand

HAND = ["trainer.save_interval=2", "trainer.save_total_limit=3", "journal.retain_samples=since_oldest_snapshot"]


def index_and_pruned(run) -> tuple[list[int], int]:
    with open_journal_reader(run / "journal") as j:
        return sorted(j.meta.snapshots()), j.retention.pruned_through()


def test_snapshots_deleted_by_hand_leave_the_index_and_nothing_is_rotated_or_pruned_against_them(tmp_path):
    """rm -rf of the two newest snapshots, then --resume: they leave the index in one warning each,
    the good older one is neither rotated out nor pruned past, and every step replays exactly from it."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    for r, n in ((ref, 12), (run, 8)):  # uninterrupted runs, in this process: no interpreter to start
        assert run_train(r, None, [*TINY, f"trainer.total_steps={n}", *HAND]).snapshots_failed is None  # as `verlj train` exits 0
    assert index_and_pruned(run) == ([4, 6, 8], 4)
    shutil.rmtree(run / "step_00006")
    shutil.rmtree(run / "step_00008")
    v = cli("verify", run)
    assert v.returncode == 0 and "DAMAGED" not in v.stdout, v.stdout  # missing is not damage: a ⚠, and what resume does
    for s in (6, 8):
        assert (f"⚠ step_{s:05d} is in the index but not on disk (deleted by hand?): the next --resume removes it from the index; "
                "it is never counted, rotated against or pruned against") in v.stdout.splitlines(), v.stdout
    assert "Resume is possible from step_00004, then replay steps 5–8 from the journal." in v.stdout
    out = train(run, "trainer.total_steps=12", *HAND, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("[WARNING]")] == [
        f"[WARNING] step_{s:05d} is in the index but not on disk (deleted by hand?): removed from the index" for s in (6, 8)]
    assert f"Resuming from checkpoint: {run / 'step_00004'}" in out.stdout
    # step_00004 is the oldest snapshot on disk and whole: kept (3 of them now), and nothing pruned past it
    assert index_and_pruned(run) == ([4, 10, 12], 4)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_00004", "step_00010", "step_00012"]
    assert fingerprints(run) == fingerprints(ref)
    mine, theirs = comparable_steps(run), comparable_steps(ref)
    assert all(_same(a, b) for a, b in zip(mine[8:], theirs[8:], strict=True))  # the live steps 9-12 (ref pruned 5-8)
    deep = cli("verify", run, "--deep")
    assert deep.returncode == 0, deep.stdout + deep.stderr
    assert "✓ Replayed to step 10 from step_00004: every fingerprint matches" in deep.stdout  # steps 5-10 from the older one
    assert "✓ Replayed to step 12 from step_00010: every fingerprint matches" in deep.stdout
    for s in (6, 8):
        assert f"· step_{s:05d} was in the index but not on disk (deleted by hand?); a resume removed it from the index" in deep.stdout
    inspect = cli("inspect", run, check=True).stdout
    assert "missing    step_00006 was in the index but not on disk (deleted by hand?): a resume removed it from the index" in inspect


def test_a_snapshot_deleted_while_the_run_trains_is_not_counted_and_the_older_one_brings_the_run_back(tmp_path):
    """save_total_limit=2, step_00006 deleted by hand while step 7 trains: at step 8 rotation counts only
    the snapshots on disk and whole, so step_00004 stays and retention does not prune past it; one
    flipped byte in step_00008 later, the run is still brought back, exactly, from step_00004."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    live = ["trainer.save_interval=2", "trainer.save_total_limit=2", "journal.retain_samples=since_oldest_snapshot"]
    assert run_train(ref, None, [*TINY, "trainer.total_steps=10", *live]).snapshots_failed is None  # in this process, as `verlj train` exits 0
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, "trainer.total_steps=8", *live]
    p = popen(cmd, env=env(VERLJ_FAILPOINT="step.before_commit:7:sleep=3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # time to delete it before step 8's snapshot
    for line in p.stdout:
        if line.startswith("[INFO] Step 6: Saving checkpoint"):
            shutil.rmtree(run / "step_00006")
            break
    rest, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert index_and_pruned(run) == ([4, 6, 8], 4)  # step_00006 is still named (no resume yet), never counted nor pruned against
    assert (run / "step_00004").is_dir()
    v = cli("verify", run)
    assert v.returncode == 0 and "⚠ step_00006 is in the index but not on disk" in v.stdout, v.stdout
    data = bytearray((run / "step_00008" / "actor" / "mp_rank_00_model_states.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (run / "step_00008" / "actor" / "mp_rank_00_model_states.pt").write_bytes(bytes(data))
    out = train(run, "trainer.total_steps=10", *live, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step_00006 is in the index but not on disk (deleted by hand?): removed from the index" in out.stderr
    assert "Skipping damaged snapshot" in out.stderr and f"Resuming from checkpoint: {run / 'step_00004'}" in out.stdout
    assert fingerprints(run) == fingerprints(ref)
    assert (run / "quarantine" / "step_00008").is_dir() and index_and_pruned(run)[0] == [4, 10]


TESTS = str(REPO / "tests")  # agents_for_tests, tools_for_tests, envs_for_tests
KEPT_WHOLE = {
    "agent_calls": ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:ticketing", "rollout.max_turns=2",
                    "rollout.tools=[tools_for_tests:open_ticket]"],
    "env_states": ["model.tiny.vocab=ascii", "rollout.env=envs_for_tests:Logged", "rollout.max_turns=3"],
}


@pytest.mark.parametrize("column", list(KEPT_WHOLE))
def test_the_archive_keeps_an_agents_calls_and_an_envs_states(tmp_path, column):
    """A pruned step's samples, from the archive, carry what the journal held: an agent episode's model and tool calls (their
    idempotency keys included) and an env's state() after reset and each step. `inspect --step` shows them as it does on
    the same run without retention, and `export --rollouts` has them as a column, the journal's JSON text."""
    ref, pruned = tmp_path / "ref", tmp_path / "pruned"
    extra = {"PYTHONPATH": TESTS, "VERLJ_TEST_EFFECTS": str(tmp_path / "effects"), "VERLJ_TEST_ENV_LOG": str(tmp_path / "env.log")}
    for run, keep in ((ref, SNAPS), (pruned, RETAIN)):
        out = train(run, *KEPT_WHOLE[column], "trainer.total_steps=6", *keep, **extra)
        assert out.returncode == 0, out.stderr[-3000:]
    with open_journal_reader(pruned / "journal") as j:
        assert j.read_step(1).pruned
    with open_journal_reader(ref / "journal") as j:
        held = [str(t) for t in j.read_step(1).first("buffer.add")["samples"][column]]
    assert held and all(held), held
    shown = {run: json.loads(runs_own(cli("inspect", run, "--step", "1", "--json", check=True).stdout))["samples"] for run in (ref, pruned)}
    assert shown[pruned] == shown[ref]
    what = "tools" if column == "agent_calls" else "reset_state"
    assert all(s[what] for s in shown[pruned]), shown[pruned][0]
    if column == "agent_calls":
        assert all(t["key"] for s in shown[pruned] for t in s["tools"])
    cli("export", pruned, "--rollouts", "--steps", "1:1", "--format", "jsonl", "--output", tmp_path / "r.jsonl", check=True)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [runs_own(r[column]) for r in rows] == [runs_own(h) for h in held]


def runs_own(text: str) -> str:
    """`text` with each idempotency key's part that names its run (rl.gateway: verlj-<run>-e<episode>-t<call>) made alike."""
    import re

    return re.sub(r"verlj-[0-9a-f]{16}-e", "verlj-RUN-e", text)
