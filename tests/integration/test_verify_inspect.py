"""`verlj verify` on damaged fixtures, and the post-mortem commands (inspect, metrics, find, diff)."""

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from journal_helpers import raw_get, raw_put, tamper
from verlj.engine.config import Config
from verlj.engine.loop.ledger import Ledger
from verlj.engine.loop.recovery import choose_snapshot
from verlj.engine.loop.run import train as run_train
from verlj.journal import Journal, make_event
from verlj_testing import TINY, cli, env, popen, train

PPO = ["algorithm.name=ppo", "distributed.zero_stage=1", "trainer.total_steps=5", "trainer.save_interval=2",
       "trainer.save_total_limit=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = tmp_path_factory.mktemp("v") / "run"
    run_train(r, None, [*TINY, *PPO])
    return r


@pytest.fixture
def copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def digest_tree(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "lock.mdb":
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


class Quiet:
    def warn(self, msg):
        self.last = msg

    def info(self, msg):
        pass


def resume_choice(run_dir):
    with Ledger.open_reader(run_dir) as j:
        step, _ = choose_snapshot(run_dir, j, j.last_step(), Quiet())
    return step


def test_intact_run(run):
    before = digest_tree(run)
    out = cli("verify", run)
    assert out.returncode == 0, out.stdout + out.stderr
    for line in ("✓ Journal intact: steps 1–5", "✓ Model state dict loaded successfully", "✓ Optimizer state loaded",
                 "✓ RNG state verified (torch, numpy, python)", "✓ Dataflow anchor parsed (dataloader index=",
                 "✓ All files present and checksum matched", "→ Checkpoint is valid for resume.", "Resume is possible from step_00005."):
        assert line in out.stdout, line
    assert digest_tree(run) == before  # verify never writes to the run
    rep = json.loads(cli("verify", run, "--json").stdout)
    assert rep["ok"] and [s["name"] for s in rep["snapshots"]] == ["step_00002", "step_00004", "step_00005"]


def flip(path, where=0.5):
    b = bytearray(path.read_bytes())
    b[int(len(b) * where)] ^= 0x04
    path.write_bytes(bytes(b))


DAMAGE = {
    "model states": lambda s: flip(s / "actor" / "mp_rank_00_model_states.pt"),
    "critic model states": lambda s: flip(s / "critic" / "mp_rank_00_model_states.pt", 0.9),
    "optimizer states": lambda s: flip(next((s / "actor").glob("*optim_states.pt"))),
    "dataflow anchor": lambda s: flip(s / "dataflow_anchor.msgpack"),
    "rng": lambda s: flip(s / "rng_rank00000.msgpack"),
    "meta": lambda s: flip(s / "meta.json", 0.2),
    "truncated": lambda s: (s / "actor" / "mp_rank_00_model_states.pt").write_bytes((s / "actor" / "mp_rank_00_model_states.pt").read_bytes()[:1000]),
    "missing file": lambda s: (s / "dataflow_anchor.msgpack").unlink(),
    "missing manifest": lambda s: (s / "manifest.json").unlink(),
    "wrong size": lambda s: (s / "meta.json").write_bytes((s / "meta.json").read_bytes() + b" "),
    "garbled manifest": lambda s: (s / "manifest.json").write_text("{not json"),
}
EXPECT = {
    "model states": "actor/mp_rank_00_model_states.pt fails its checksum",
    "critic model states": "critic/mp_rank_00_model_states.pt fails its checksum",
    "optimizer states": "actor/zero_pp_rank_0_mp_rank_00_optim_states.pt fails its checksum",
    "dataflow anchor": "dataflow_anchor.msgpack fails its checksum",
    "rng": "rng_rank00000.msgpack fails its checksum",
    "meta": "meta.json fails its checksum",
    "truncated": "actor/mp_rank_00_model_states.pt has 1000 bytes, the manifest says",
    "missing file": "dataflow_anchor.msgpack is missing",
    "missing manifest": "manifest.json is missing",
    "wrong size": "meta.json has",
    "garbled manifest": "manifest.json does not match the digest the journal recorded for it",
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_snapshot_is_named_and_skipped(copy, kind):
    DAMAGE[kind](copy / "step_00005")
    out = cli("verify", copy)
    assert out.returncode == 1, out.stdout
    assert f"✗ {EXPECT[kind]}" in out.stdout, out.stdout
    assert "Resume is possible from step_00004, then replay steps 5–5 from the journal." in out.stdout
    assert resume_choice(copy) == 4  # what --resume picks
    single = cli("verify", copy / "step_00005")
    assert single.returncode == 1 and EXPECT[kind] in single.stdout


def test_resume_skips_the_damaged_snapshot(copy):
    (copy / "step_00005" / "manifest.json").unlink()
    out = train(copy, *PPO, "trainer.total_steps=6", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Skipping damaged snapshot" in out.stderr and "manifest.json is missing" in out.stderr
    assert "Resuming from checkpoint" in out.stdout and "step_00004" in out.stdout


def test_damaged_journal_record(copy):
    def f(txn, db):
        v = bytearray(raw_get(txn, db, 3))
        v[-5] ^= 0x10
        raw_put(txn, db, 3, bytes(v))

    tamper(copy / "journal", f)
    out = cli("verify", copy)
    assert out.returncode == 1
    assert "✗ journal step 3: bad_checksum" in out.stdout
    # resume refuses a damaged journal, so verify does not offer one: it names the way forward from
    # the last intact step instead (the same words --resume prints)
    assert "Resume is possible" not in out.stdout
    assert "Resume is not possible: the journal is damaged" in out.stdout
    assert f"`verlj replay {copy} --to-step 2 --fork NEW_RUN`" in out.stdout


def _truncate(run):
    data = run / "journal" / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _bad_record(run):
    def f(txn, db):
        v = bytearray(raw_get(txn, db, 3))
        v[-5] ^= 0x10
        raw_put(txn, db, 3, bytes(v))

    tamper(run / "journal", f)


@pytest.mark.parametrize("damage, why", [(_truncate, "the journal cannot be read"), (_bad_record, "the journal is damaged")])
def test_on_a_damaged_journal_verify_says_resume_keeps_every_snapshot_and_it_does(copy, damage, why):
    """Resume refuses a damaged journal before it touches the run directory, so no snapshot is a
    leftover it removes: verify says what the refusal keeps (from the plan the resume itself follows)."""
    shutil.copytree(copy / "step_00004", copy / "step_00003")  # published, never indexed
    (copy / ".tmp-step_00006" / "actor").mkdir(parents=True)  # a killed run's temporary
    damage(copy)
    out = cli("verify", copy)
    assert out.returncode == 1 and "Resume is not possible" in out.stdout, out.stdout
    assert "left by an interrupted run" not in out.stdout and "removes it" not in out.stdout, out.stdout
    unindexed = ["step_00003", ".tmp-step_00006"] + (["step_00002", "step_00004", "step_00005"] if damage is _truncate else [])
    for name in unindexed:  # a truncated journal's index cannot be read: the three intact snapshots are named too
        assert f"· {name}: kept as it is: {why}, so --resume refuses the run before touching any snapshot" in out.stdout, out.stdout
    snaps = {p.name: digest_tree(p) for p in copy.iterdir() if p.name.startswith(("step_", ".tmp-"))}
    res = train(copy, *PPO, "trainer.total_steps=6", resume=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert {p.name: digest_tree(p) for p in copy.iterdir() if p.name.startswith(("step_", ".tmp-"))} == snaps
    assert not (copy / "quarantine").exists()


def test_verify_usage_errors(tmp_path):
    out = cli("verify", tmp_path / "nope")
    assert out.returncode == 2 and "does not exist" in out.stderr
    (tmp_path / "plain").mkdir()
    out = cli("verify", tmp_path / "plain")
    assert out.returncode == 2 and "is not a verlj run" in out.stderr and "Traceback" not in out.stderr


def test_verify_deep(run):
    out = cli("verify", run, "--deep")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "✓ Replayed to step 4 from step_00002: every fingerprint matches" in out.stdout
    assert "✓ Replayed to step 5 from step_00004: every fingerprint matches" in out.stdout


def test_inspect_summary_and_step(run):
    out = cli("inspect", run)
    assert out.returncode == 0
    assert "5 committed, last step 5" in out.stdout and "step_00004" in out.stdout and "algorithm ppo" in out.stdout
    out = cli("inspect", run, "--step", 3)
    assert out.returncode == 0
    assert "fingerprint" in out.stdout and "+" in out.stdout and "→" in out.stdout and "actor/pg_loss" in out.stdout
    d = json.loads(cli("inspect", run, "--step", 3, "--json").stdout)
    assert d["step"] == 3 and len(d["samples"]) == 16 and d["samples"][0]["prompt"].endswith("=")
    assert set(d["buffer"]["consumed"]) <= {s["id"] for s in d["samples"]}
    for bad in (0, 6):
        out = cli("inspect", run, "--step", bad)
        assert out.returncode == 2 and "out of range" in out.stderr and "Traceback" not in out.stderr


def test_commands_refuse_a_non_run(tmp_path):
    for args in (["inspect", tmp_path], ["metrics", tmp_path], ["find", tmp_path, "--where", "a > 1"],
                 ["diff", tmp_path, tmp_path], ["inspect", tmp_path / "missing"]):
        out = cli(*args)
        assert out.returncode == 1 and out.stderr.count("error:") == 1 and "Traceback" not in out.stderr, args


def test_metrics_outputs(run, tmp_path):
    out = cli("metrics", run, "--names", "actor/pg_loss,critic/vf_loss", "--steps", "2:4", "--csv")
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "step,actor/pg_loss,critic/vf_loss" and [l.split(",")[0] for l in lines[1:]] == ["2", "3", "4"]
    rows = [json.loads(l) for l in cli("metrics", run, "--jsonl").stdout.splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and "critic/score/mean" in rows[0]
    out = cli("metrics", run, "--names", "actor/nope")
    assert out.returncode == 2 and "unknown metric 'actor/nope'" in out.stderr
    out = cli("metrics", run, "--steps", "9:2")
    assert out.returncode == 2 and "START is after STOP" in out.stderr
    assert "actor/pg_loss" in cli("metrics", run, "--names", "actor/pg_loss").stdout


def test_plot_is_a_png_with_one_panel_per_metric(run, tmp_path):
    import matplotlib.image as mpimg

    png = tmp_path / "m.png"
    out = cli("metrics", run, "--names", "actor/pg_loss,critic/score/mean,critic/vf_loss", "--plot", png)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(png)
    assert img.shape[0] == round(3 * 2.2 * 90) and img.shape[1] == 9 * 90  # three stacked panels at 90 dpi
    # each panel draws its own curve: the image is not blank
    assert float(np.std(img[..., :3])) > 0.05


def test_find(run, tmp_path):
    out = cli("find", run, "--where", "critic/score/mean >= 0")
    assert out.returncode == 0 and "5 step(s) match" in out.stdout and "first: 1" in out.stdout
    hits = json.loads(cli("find", run, "--where", "batch/samples == 16 and actor/ppo_kl < 100", "--json").stdout)
    assert [h["step"] for h in hits] == [1, 2, 3, 4, 5]
    for bad, msg in (("grad_norm >", "cannot parse --where"), ("x > y", "is not a number"), ("nope > 1", "unknown metric 'nope'")):
        out = cli("find", run, "--where", bad)
        assert out.returncode == 2 and msg in out.stderr and "Traceback" not in out.stderr, bad
    # NaN and inf are findable
    nan_run = tmp_path / "nan"
    with Journal.open_writer(nan_run / "journal") as j:
        j.meta.set("config", Config().to_dict())
        for s, v in enumerate([0.5, float("nan"), float("inf"), 1.0], start=1):
            j.writer.append_step(s, [make_event("metrics", values={"actor/grad_norm": v})])
    assert "first: 2" in cli("find", nan_run, "--where", "actor/grad_norm is nan").stdout
    assert "first: 3" in cli("find", nan_run, "--where", "actor/grad_norm is inf").stdout
    assert "2 step(s)" in cli("find", nan_run, "--where", "actor/grad_norm is not finite").stdout


def test_diff(run, tmp_path):
    out = cli("diff", run, run)
    assert out.returncode == 0 and "identical" in out.stdout
    # a run that agrees for 3 steps, then changes its clip ratio
    other = tmp_path / "other"
    run_train(other, None, [*TINY, *PPO, "trainer.total_steps=3"])
    r = train(other, *PPO, "model.actor.optim.lr=0.005", "--allow-config-change", resume=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = cli("diff", run, other)
    assert out.returncode == 1
    assert "first difference at step 4: metrics, stage digests, fingerprint" in out.stdout and "actor/lr" in out.stdout
    assert "first differing stage: state" in out.stdout  # the data, samples, advantages, loss and gradients agree
    d = json.loads(cli("diff", run, other, "--json").stdout)
    assert d["step"] == 4 and "state" in d["differs"]


def test_diff_names_an_environment_difference_apart_from_a_training_one(run, tmp_path):
    # the same run trained where the installed transformers says another version (as installing an extra moves it)
    site = tmp_path / "site"
    (site / "transformers-5.24.0.dist-info").mkdir(parents=True)
    (site / "transformers-5.24.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.24.0\n")
    other = tmp_path / "other"
    r = train(other, *PPO, PYTHONPATH=site)
    assert r.returncode == 0, r.stderr[-2000:]
    import transformers

    here = transformers.__version__
    assert here != "5.24.0"
    out = cli("diff", run, other)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"identical: {run} and {other} agree on all 5 steps (timings aside)" in out.stdout
    assert f"environment only (every fingerprint and metric agrees): transformers {here} vs 5.24.0" in out.stdout
    assert "first difference" not in out.stdout
    assert cli("diff", run, other, "--strict-env").returncode == 1
    d = json.loads(cli("diff", run, other, "--json").stdout)
    assert d["identical"] and d["environment"] == {"transformers": [here, "5.24.0"]}
    # a training difference still exits 1, with the environment named beside it
    r = train(other, *PPO, "trainer.total_steps=6", resume=True, PYTHONPATH=site)
    assert r.returncode == 0, r.stderr[-2000:]
    out = cli("diff", run, other)
    assert out.returncode == 1 and "the runs agree up to step 5" in out.stdout
    assert f"  environment: transformers {here} vs 5.24.0" in out.stdout


def test_commands_work_while_training_writes(tmp_path):
    live = tmp_path / "live"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(live), *TINY, "trainer.total_steps=400",
           "trainer.save_interval=50"]
    p = popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in p.stdout:
            if "[INFO] Step 3:" in line:
                break
        for args in (["inspect", live], ["inspect", live, "--step", 2], ["metrics", live, "--csv"],
                     ["find", live, "--where", "critic/score/mean >= 0"], ["verify", live]):
            out = cli(*args)
            assert out.returncode == 0, (args, out.stdout[-1000:], out.stderr[-2000:])
        assert p.poll() is None  # still training, undisturbed
    finally:
        p.terminate()
        p.wait(timeout=120)
    assert p.returncode == 0  # SIGTERM: graceful stop
