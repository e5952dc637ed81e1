"""The failure paths users met, by subject: each ends in one clear line, a non-zero exit, and no
damage to an existing run; no false alarm, no lost snapshot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verlj.engine.loop.run import train as run_train
from verlj.journal import Journal
from verlj_testing import REPO, SMALL, TINY, assert_same_journal, cli, env, fingerprints, popen, train, verlj


def one_line_error(out, code, text):
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and text in errors[0], out.stderr[-3000:]
    return errors[0]


def refused_in_one_line(call, code, text):
    """What one_line_error checks, on the engine call a command makes: the VerljError it raises is the
    command's one `error: ` line (one sentence, naming `text`) and its exit code."""
    from verlj.journal import VerljError

    with pytest.raises(VerljError) as refused:
        call()
    assert refused.value.exit_code == code and "\n" not in str(refused.value) and text in str(refused.value), str(refused.value)


def tree(root: Path) -> dict[str, bytes]:
    """A run's files, but its locks: LMDB's, and the writers' claims (RUN/writer), which every writer that starts adds to."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("lock.mdb", "writer.lock") and p.relative_to(root).parts[0] != "writer"}




@pytest.fixture(scope="module")
def base6(tmp_path_factory):
    """`base`'s config trained straight to 6 steps: the reference the resumes of a copy of `base` to step 6
    are compared with (made once per module, only read)."""
    run = tmp_path_factory.mktemp("base6") / "run"
    run_train(run, None, [*SMALL, "trainer.total_steps=6"])
    return run


# ----------------------------------------------------------------------------- verify while rotation deletes


def test_verify_does_not_call_a_rotated_snapshot_damaged(copy, monkeypatch):
    """Rotation (another process) unindexes and deletes a snapshot while verify reads it."""
    from verlj.engine.post_mortem import verify as verify_mod

    real = verify_mod.verify_snapshot
    rotate = ("from verlj.journal import Journal; import shutil, sys\n"
              "with Journal.open_writer(sys.argv[1] + '/journal') as j: j.meta.remove_snapshot(2)\n"
              "shutil.rmtree(sys.argv[1] + '/step_00002')\n")

    def racing(path, *a, **kw):
        if path.name == "step_00002":
            subprocess.run([sys.executable, "-c", rotate, str(copy)], check=True, env=env())
        return real(path, *a, **kw)

    monkeypatch.setattr(verify_mod, "verify_snapshot", racing)
    report = verify_mod.verify_run(copy)
    assert report.ok, verify_mod.render(report)
    assert report.rotated == ["step_00002"] and [s.name for s in report.snapshots] == ["step_00004"]
    assert "rotated away by the live run" in verify_mod.render(report)


# ----------------------------------------------------------------------------- stdout and cold start


def test_replay_json_is_alone_on_stdout_and_no_extension_is_built(base, tmp_path):
    ext = tmp_path / "torch_extensions"
    out = verlj("replay", base, "--to-step", 3, "--json", TORCH_EXTENSIONS_DIR=ext)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == {"step": 3, "fingerprint": fingerprints(base)[3], "from_snapshot": 2, "exact": True,
                                      "tolerant_steps": 0, "max_deviation": None}
    # nothing was JIT-compiled (DeepSpeed's CPU shared-memory op took ~100 s on a fresh machine)
    assert not ext.exists() or not any(ext.rglob("*.so")), list(ext.rglob("*"))


# ----------------------------------------------------------------------------- bad input: one line, nothing left behind


def test_user_code_that_fails_leaves_no_run(tmp_path):
    mod = tmp_path / "code"
    mod.mkdir()
    (mod / "hard_rewards.py").write_text(
        "def boom(prompt, response, answer):\n    raise KeyError('answer')\n"
        "def good(prompt, response, answer):\n    import numpy as np\n    return np.float64(len(response) > 0)\n"
    )
    (mod / "hard_policy.py").write_text(
        "class Loud:\n    def __init__(self, every=2):\n        self.every = every\n"
        "    def should_save(self, state, history):\n        raise RuntimeError('policy bug')\n"
        "class Maybe:\n    def should_save(self, state, history):\n        return 'yes'\n"
    )
    run = tmp_path / "r"
    out = train(run, "rollout.reward_fn=hard_rewards:boom", PYTHONPATH=mod)
    one_line_error(out, 1, "reward function hard_rewards.boom raised KeyError")
    assert not run.exists()
    out = train(run, "trainer.checkpoint_policy=hard_policy.Loud", "trainer.checkpoint_policy_kwargs={every: 3}", PYTHONPATH=mod)
    one_line_error(out, 1, "trainer.checkpoint_policy: hard_policy.Loud.should_save raised RuntimeError: policy bug")
    assert not run.exists()
    out = train(run, "trainer.checkpoint_policy=hard_policy.Maybe", PYTHONPATH=mod)
    one_line_error(out, 1, "returned 'yes'; it must return a bool")
    out = train(run, "trainer.checkpoint_policy=hard_policy.Loud", "trainer.checkpoint_policy_kwargs={nope: 1}", PYTHONPATH=mod)
    one_line_error(out, 1, "hard_policy.Loud(**trainer.checkpoint_policy_kwargs) failed: TypeError")
    assert not run.exists()
    # the same directory takes a clean retry with a working function (numpy scalars are numbers)
    out = train(run, "rollout.reward_fn=hard_rewards:good", "trainer.total_steps=1", PYTHONPATH=mod)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("override, text", [
    ("model.actor.optim.lr=.nan", "model.actor.optim.lr must be a finite number"),
    ("rollout.temperature=.inf", "rollout.temperature must be a finite number"),
    ("trainer.seed=18446744073709551616", "trainer.seed must be between 0 and 9223372036854775807"),
    ("trainer.resume_from=-3", "trainer.resume_from must be null, auto, a snapshot path or a step number >= 0"),
])
def test_bad_values_are_refused_up_front(tmp_path, override, text):
    if override.startswith("model."):  # one through the real command in a process of its own: one line, exit 2
        one_line_error(train(tmp_path / "r", override), 2, text)
    else:  # the rest on the call `verlj train` makes (it prints "error: " + the sentence, exits with its exit_code)
        refused_in_one_line(lambda: run_train(tmp_path / "r", None, [*TINY, override]), 2, text)
    assert not (tmp_path / "r").exists()


def test_non_utf8_dataset_and_yaml_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "1"}\n')
    one_line_error(train(tmp_path / "r", f"data.train_dataset={data}", "rollout.reward_fn=builtin:add"), 1, f"line 2 of {data} is not UTF-8 text")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 5\n  seed: [1,\nmodel: {}\n")
    one_line_error(verlj("train", "--config", bad, "-o", tmp_path / "r"), 2, "not valid YAML at line 3")
    assert not (tmp_path / "r").exists()


def test_plot_without_matplotlib(base, tmp_path):
    blocker = tmp_path / "block"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = verlj("metrics", base, "--plot", tmp_path / "m.png", PYTHONPATH=blocker)
    one_line_error(out, 2, "--plot needs matplotlib")
    assert not (tmp_path / "m.png").exists()


# ----------------------------------------------------------------------------- config changes on resume


@pytest.mark.parametrize("key", ["trainer.precision=bf16", "trainer.seed=7", "trainer.num_threads=2",
                                 "trainer.deterministic=false", "algorithm.name=ppo"])
def test_allow_config_change_refuses_engine_and_determinism_keys(copy, key):
    before = tree(copy)
    said = f"{key.split('=')[0]} cannot change within a run"
    if key == "algorithm.name=ppo":  # one through the real command in a process of its own: one line, exit 2
        one_line_error(train(copy, *SMALL, "trainer.total_steps=5", key, "--allow-config-change", resume=True), 2, said)
    else:  # the rest on the call `verlj train --resume --allow-config-change` makes
        refused_in_one_line(lambda: run_train(copy, None, [*SMALL, "trainer.total_steps=5", key], resume=True,
                                              allow_config_change=True), 2, said)
    assert tree(copy) == before


# ----------------------------------------------------------------------------- damaged snapshots and leftovers


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def test_damaged_snapshot_is_quarantined_and_good_ones_kept(copy, base6):
    flip(next((copy / "step_00004" / "actor").iterdir()))
    assert cli("verify", copy).returncode == 1  # before the resume: the damage is reported
    out = train(copy, *SMALL, "trainer.total_steps=6", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moved to" in out.stderr and (copy / "quarantine" / "step_00004").is_dir()
    with Journal.open_reader(copy / "journal") as j:
        assert sorted(j.meta.snapshots()) == [2, 6]  # rotation kept the good step 2, not the damaged 4
    out = cli("verify", copy)
    assert out.returncode == 0, out.stdout
    assert "step_00004 was set aside by a resume and moved to quarantine/step_00004" in out.stdout
    md = json.loads((copy / "train_metadata.json").read_text())
    assert md["resume_from"] == "step_00002" and md["global_step"] == 6
    assert_same_journal(copy, base6)


def test_leftovers_are_reported_then_sorted_out(copy):
    (copy / ".tmp-step_00005" / "actor").mkdir(parents=True)
    shutil.copytree(copy / "step_00004", copy / "step_00003")  # published, never indexed, and not step 3's state
    out = cli("verify", copy)
    assert out.returncode == 0, out.stdout
    assert ".tmp-step_00005: left by an interrupted run" in out.stdout
    # verify says what the resume below does with it (the same plan): quarantined, never removed
    assert ("· step_00003: published but not in the index, and its meta says step 4, its name and the index say 3: the next "
            "--resume quarantines it (moves it to quarantine/)") in out.stdout, out.stdout
    out = train(copy, *SMALL, "trainer.total_steps=5", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Removed what an interrupted run left behind: .tmp-step_00005" in out.stdout
    # a published snapshot is never deleted by a resume: one that fails its checks is quarantined
    assert "Quarantined step_00003 to quarantine/step_00003: published but not indexed, and its meta says step 4" in out.stdout
    assert not (copy / ".tmp-step_00005").exists() and (copy / "quarantine" / "step_00003" / "manifest.json").is_file()
    out = cli("verify", copy)
    assert "left by" not in out.stdout and "step_00003 was set aside by a resume" in out.stdout


def test_weights_copies_of_killed_vllm_starts_are_listed_then_removed(copy, tmp_path):
    """In a directory of the test's own (VERLJ_WEIGHTS_COPY_DIR): in /dev/shm, any `verlj train` of a test
    running beside this one would remove the stale copy first."""
    from verlj.engine.rl.vllm_engine import COPY_DIR_ENV, COPY_PREFIX
    from verlj.journal.claim import process_start

    root = tmp_path / "shm"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f"{COPY_PREFIX}{int(gone.stdout)}-0-test"  # its process is gone
    live = root / f"{COPY_PREFIX}{os.getpid()}-{process_start(os.getpid())}-test"  # this one runs
    for d in (stale, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 4096)
    v = verlj("verify", copy, **{COPY_DIR_ENV: str(root)})
    assert f"· {stale} (0.0 MiB): a weights copy a killed vLLM start left on this node" in v.stdout, v.stdout
    assert str(live) not in v.stdout
    out = train(copy, *SMALL, "trainer.total_steps=5", resume=True, **{COPY_DIR_ENV: str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Removed {stale} (0.0 MiB): a weights copy left by a killed vLLM start" in out.stdout
    assert not stale.exists() and live.is_dir()


# ----------------------------------------------------------------------------- a damaged journal: one answer


def test_verify_and_resume_agree_on_a_damaged_journal(copy, base, tmp_path):
    from journal_helpers import raw_get, raw_put, tamper

    def damage(txn, db):
        bad = bytearray(raw_get(txn, db, 3))
        bad[len(bad) // 2] ^= 1
        raw_put(txn, db, 3, bytes(bad))

    tamper(copy / "journal", damage)
    advice = f"`verlj replay {copy} --to-step 2 --fork NEW_RUN`"
    out = cli("verify", copy)
    assert out.returncode == 1 and "Resume is not possible" in out.stdout and advice in out.stdout, out.stdout
    out = train(copy, *SMALL, "trainer.total_steps=5", resume=True)
    assert advice in one_line_error(out, 1, "the journal is damaged")
    # the way forward works
    new = tmp_path / "new"
    out = verlj("replay", copy, "--to-step", 2, "--fork", new, "trainer.total_steps=4")
    assert out.returncode == 0, out.stderr[-2000:]
    assert fingerprints(new) == {s: fp for s, fp in fingerprints(base).items() if s > 2}  # the same state, exactly


# ----------------------------------------------------------------------------- runs that never committed a step


def test_resume_on_an_empty_directory_says_so(tmp_path):
    (tmp_path / "r").mkdir()
    out = train(tmp_path / "r", "trainer.total_steps=1", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No run in" in out.stdout and "starting a new one" in out.stdout


def test_a_run_killed_before_its_first_step_does_not_block_a_retry(tmp_path):
    run = tmp_path / "r"
    out = train(run, VERLJ_FAILPOINT="step.before_commit:1")
    assert out.returncode == -9
    with Journal.open_reader(run / "journal") as j:
        assert j.last_step() == 0
    # a --resume with a different (fixed) reward function starts afresh; so would a plain start
    out = train(run, "trainer.total_steps=2", "rollout.reward_fn=verlj.engine.rl.rewards:add_reward", resume=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "never committed a step; starting it afresh" in out.stdout
    assert sorted(fingerprints(run)) == [1, 2]


# ----------------------------------------------------------------------------- journal/ or train_metadata.json lost


def test_a_run_whose_journal_is_lost_is_refused_and_nothing_is_moved(copy):
    """Snapshots, train_metadata.json and metrics.jsonl without journal/: a past run, not one that never
    started. Every command says so in one line; nothing is moved, quarantined or replaced."""
    shutil.rmtree(copy / "journal")
    before = tree(copy)
    said = f"{copy} has snapshots (step_00002, step_00004), train_metadata.json at step 4 and metrics.jsonl but no journal/"
    for resume in (True, False):
        line = one_line_error(train(copy, *SMALL, "trainer.total_steps=6", resume=resume), 1, said)
        assert "nothing was changed" in line and f"Restore {copy / 'journal'} from a backup" in line, line
        assert f"`verlj verify {copy / 'step_00004'}`" in line, line
    for args in (("verify", copy), ("inspect", copy), ("replay", copy, "--to-step", 3), ("journal", "verify", copy)):
        one_line_error(verlj(*args), 1, said)
    assert tree(copy) == before and not (copy / "journal").exists() and not (copy / "quarantine").exists()
    assert cli("verify", copy / "step_00004").returncode == 0  # what the sentence offers works


def test_a_lost_train_metadata_json_is_harmless(base, copy, base6):
    """The journal is the truth, train_metadata.json its mirror: the resume continues exactly and writes it
    again. (`copy` is a cp of a run keeping its LMDB journal in RUN/journal: a journal of its own.)"""
    reference = base6
    (copy / "train_metadata.json").unlink()
    out = train(copy, *SMALL, "trainer.total_steps=6", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(copy) == fingerprints(reference) and sorted(fingerprints(copy)) == list(range(1, 7))
    assert_same_journal(reference, copy)
    meta = json.loads((copy / "train_metadata.json").read_text())
    assert meta["global_step"] == 6 and meta["last_snapshot"] == "step_00006", meta
    assert sorted(fingerprints(base)) == [1, 2, 3, 4]  # the run it was copied from is as it was


def test_a_copy_made_while_its_run_is_written_names_the_writer_of_the_original(base, tmp_path):
    """cp -a of a live run carries its claim along: the copy's resume names the process writing the
    original (not the copy) and waits for it; once that process is gone, the copy resumes exactly. The
    original's claim is never touched by the copy."""
    run, copy = tmp_path / "run", tmp_path / "copy"
    cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *SMALL]
    proc = popen(cmd, env=env(VERLJ_FAILPOINT="step.before_commit:3:sleep=120"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and 2 not in _snapshots(run):
            time.sleep(0.1)
        assert 2 in _snapshots(run)
        time.sleep(1)  # step 3 runs into its failpoint: nothing is written while it sleeps
        shutil.copytree(run, copy, symlinks=True)
        claims = {p.name: p.read_bytes() for p in (run / "writer").iterdir()}
        out = train(copy, *SMALL, resume=True)
        line = one_line_error(out, 1, f"run {copy} holds a claim copied from {run.resolve()}, which pid {proc.pid} ")
        assert "stop that process first" in line
        assert {p.name for p in (run / "writer").iterdir()} == set(claims)  # the copy's claims are its own
    finally:
        proc.kill()
        proc.wait()
    out = train(copy, *SMALL, resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert fingerprints(copy) == fingerprints(base)
    assert_same_journal(base, copy)


def _snapshots(run: Path) -> dict:
    try:
        with Journal.open_reader(run / "journal") as j:
            return j.meta.snapshots()
    except Exception:  # noqa: BLE001 - not created yet
        return {}


# ----------------------------------------------------------------------------- replay outputs checked first


def test_replay_refuses_occupied_outputs_before_replaying(base, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    one_line_error(verlj("replay", base, "--to-step", 3, "--export", mine), 1, "--export")
    one_line_error(verlj("replay", base, "--to-step", 3, "--fork", mine), 1, "--fork")
    one_line_error(verlj("replay", base, "--to-step", 3, "--fork", base), 1, "already holds a run")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


# ----------------------------------------------------------------------------- user code from the working directory


def test_the_verlj_script_imports_code_from_the_working_directory(tmp_path):
    (tmp_path / "cwd_rewards.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    script = Path(sys.executable).parent / "verlj"
    out = subprocess.run([str(script), "train", "-o", "r", *TINY, "trainer.total_steps=1", "rollout.reward_fn=cwd_rewards:score"],
                         cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# ----------------------------------------------------------------------------- checkpoint policy state


def test_policy_state_travels_in_snapshots_and_resume_decides_the_same(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "count_policy.py").write_text(
        "class EveryThird:\n"
        "    def __init__(self, every):\n        self.every, self.calls = every, 0\n"
        "    def should_save(self, state, history):\n"
        "        self.calls += 1\n"
        "        assert state['samples_seen'] == 16 * state['global_step'], state\n"
        "        return self.calls % self.every == 0\n"
        "    def state_dict(self):\n        return {'calls': self.calls}\n"
        "    def load_state_dict(self, s):\n        self.calls = s['calls']\n"
    )
    over = [*TINY, "trainer.total_steps=8", "trainer.save_interval=4", "trainer.save_total_limit=0",
            "trainer.checkpoint_policy=count_policy.EveryThird", "trainer.checkpoint_policy_kwargs={every: 3}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert verlj("train", "-o", ref, *over, PYTHONPATH=code).returncode == 0
    with Journal.open_reader(ref / "journal") as j:
        assert sorted(j.meta.snapshots()) == [3, 4, 6, 8]
    out = verlj("train", "-o", run, *over, PYTHONPATH=code, VERLJ_FAILPOINT="step.before_commit:6")
    assert out.returncode == -9
    out = verlj("train", "-o", run, *over, "--resume", PYTHONPATH=code)
    assert out.returncode == 0, out.stderr[-2000:]
    with Journal.open_reader(run / "journal") as j:
        assert sorted(j.meta.snapshots()) == [3, 4, 6, 8]  # the policy's count survived the kill
    assert_same_journal(run, ref)
    md = json.loads((run / "train_metadata.json").read_text())
    assert md["samples_seen"] == 8 * 16 and md["resume_from"] == "step_00004"


# ----------------------------------------------------------------------------- the reward model's identity


def test_reward_model_identity(tmp_path):
    from test_train_cli import save_tiny_hf

    save_tiny_hf(tmp_path / "rm", "cls")
    save_tiny_hf(tmp_path / "lm", "lm")
    one_line_error(train(tmp_path / "x", f"model.reward_model.model_name_or_path={tmp_path / 'lm'}"), 1,
                   "is not a sequence-classification model")
    run = tmp_path / "run"
    over = [f"model.reward_model.model_name_or_path={tmp_path / 'rm'}", "trainer.total_steps=1"]
    assert train(run, *over).returncode == 0
    weights = next((tmp_path / "rm").glob("*.safetensors"))
    flip(weights)
    before = tree(run)
    out = train(run, *over[:1], "trainer.total_steps=2", resume=True)
    one_line_error(out, 1, "differ from the reward model this run started with")
    assert tree(run) == before


# ----------------------------------------------------------------------------- inspect, diff, help


def test_metadata_lineage_diff_and_explicit_snapshots(copy, base, tmp_path):
    md = json.loads((copy / "train_metadata.json").read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert md["git_commit"] == (head.stdout.strip() or None)
    other = tmp_path / "other"
    shutil.copytree(base, other, symlinks=True)
    out = train(copy, *SMALL, "trainer.total_steps=5", f"trainer.resume_from={other / 'step_00002'}", resume=True)
    one_line_error(out, 1, "is not a snapshot of the run in")
    lr = tmp_path / "lr"
    run_train(lr, None, [*SMALL, "model.actor.optim.lr=0.002"])
    out = cli("diff", base, lr)
    assert out.returncode == 1 and "config model.actor.optim.lr: 0.001 vs 0.002" in out.stdout, out.stdout


def test_inspect_shows_special_tokens_in_responses(base):
    d = json.loads(cli("inspect", base, "--step", 1, "--json").stdout)
    with Journal.open_reader(base / "journal") as j:
        add = next(e for e in j.read_step(1).events if e["type"] == "buffer.add")["samples"]
    eos_count = int(sum((add["response_ids"][i, : add["response_ids_len"][i]] == 2).sum() for i in range(len(add["id"]))))
    assert eos_count > 0, "no sample ended with <eos>: the check would be vacuous"
    assert sum(s["response"].count("<eos>") for s in d["samples"]) == eos_count


def test_help_shows_flags_and_defaults():
    out = verlj("train", "--help")
    assert "--resume " in out.stdout and "--resume <" not in out.stdout
    assert "verlj config show" in out.stdout
    out = verlj("inspect", "--help")
    assert out.returncode == 0 and "--max-samples" in out.stdout


def test_checkpoint_verify_is_verify_as_the_verl_tutorial_spells_it(base):
    """`verlj checkpoint verify PATH` (the tutorial users come from) is `verlj verify PATH`."""
    for path in (base / "step_00004", base):
        a, b = cli("checkpoint", "verify", path), cli("verify", path)
        assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "Checkpoint is valid for resume." in a.stdout
    missing = verlj("checkpoint", "verify", base / "step_00099")  # its own process: nothing else on stderr
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {base / 'step_00099'} does not exist"


# ----------------------------------------------------------------------------- full disk, file-size limit


@pytest.fixture
def small_disk(tmp_path):
    """A 1600 KiB tmpfs: room for the journal and one snapshot of SMALL (1.1 MB), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)], capture_output=True)
    assert mounted.returncode == 0, f"a full disk needs a small tmpfs, which needs root (CI runs as root): {mounted.stderr.strip()}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_snapshot_on_a_full_disk_is_named_and_the_run_exits_non_zero(small_disk, base):
    run = small_disk / "run"
    out = train(run, *SMALL)
    assert out.returncode == 3, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "inline_container" not in out.stderr
    assert "Snapshot at step 4 failed: no space left on the run directory's disk (" in out.stderr
    done, summary = out.stdout.strip().splitlines()[-2:]
    assert done == f"Done: last committed step 4 in {run}"
    assert summary.startswith("Snapshots failed: 1 of 2 (step 4): no space left on the run directory's disk (")
    assert " free); every step is in the journal, and a resume replays from the newest snapshot that was written" in summary
    # the failed snapshot left nothing behind, damaged nothing, and every step is the straight run's
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(("step_", ".tmp"))) == ["step_00002"]
    assert_same_journal(run, base)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    out = train(run, *SMALL, "trainer.total_steps=5", resume=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Replayed steps 3–4 from the journal." in out.stdout


def _limited(fsize: int):
    def apply():
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    return apply


def test_the_file_size_limit_is_named_for_a_snapshot_and_for_a_journal_commit(tmp_path, base):
    def limited_train(run, fsize, *extra):
        cmd = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(run), *TINY, *SMALL, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env(), cwd=REPO, preexec_fn=_limited(fsize))

    run = tmp_path / "snap"
    out = limited_train(run, 512 << 10)  # the journal fits, a snapshot's 1 MB weights file does not
    assert out.returncode == 3, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Snapshot at step 2 failed: file-size limit (ulimit -f) of 512.0 KiB reached by mp_rank_00_model_states.pt" in out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("Snapshots failed: 2 of 2 (steps 2, 4): file-size limit")
    assert_same_journal(run, base)

    run = tmp_path / "journal"
    out = limited_train(run, 40 << 10)  # the journal outgrows it within a few steps
    err = one_line_error(out, 1, "journal write failed under ")
    assert "file-size limit (ulimit -f) of 40.0 KiB reached by data.mdb" in err and "Input/output error" not in err
    out = train(run, *SMALL, resume=True)  # nothing committed was lost: the resume finishes the straight run's steps
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_journal(run, base)


# ----------------------------------------------------------------------------- small refusals (issue 34, item 7)


def test_cli_options_that_were_silently_ignored_or_misread_are_refused(base, copy, tmp_path):
    from typer.testing import CliRunner

    from verlj.cli.main import app

    def cli(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    out = cli("metrics", base, "--plot", base / "p.png")  # never into a run's directory
    assert out.exit_code == 2 and f"--plot {base / 'p.png'} is the run directory" not in out.output, out.output
    assert f"--plot {base / 'p.png'} is inside the run directory {base.resolve()}" in out.output and not (base / "p.png").exists()
    out = cli("metrics", base, "--csv", "--jsonl")
    assert out.exit_code == 2 and "--csv and --jsonl each choose the output; pass one" in out.output
    out = cli("verify", base, "--from-step", "2")
    assert out.exit_code == 2 and "pass --deep with it" in out.output
    out = cli("verify", base, "--deep", "--from-step", "99")  # it replayed nothing and said OK
    assert out.exit_code == 2 and "--from-step 99 is outside the steps this run committed (0–4)" in out.output, out.output
    one_line_error(verlj("train", "-o", tmp_path / "r", "--config", tmp_path), 2, f"config file {tmp_path} is a directory; name a YAML file")
    out = cli("journal", "verify", base)  # the run directory, as every other command takes it
    assert out.exit_code == 0 and "✓ journal intact: steps 1–4" in out.output, out.output
    # the table shows every name whole (they were cut to 'critic/scor…', three alike)
    out = cli("metrics", base, "--names", "critic/score/mean,critic/score/max,critic/score/min")
    assert out.exit_code == 0 and "…" not in out.output
    header = out.output.splitlines()[0].split()
    assert header == ["step", "critic/score/mean", "critic/score/max", "critic/score/min"], header
    # the model-path error says its key once
    err = one_line_error(train(tmp_path / "m", "model.actor.model_name_or_path=/nonexistent/m"), 1, "model directory /nonexistent/m")
    assert err.count("model.actor.model_name_or_path") == 1, err
    # a resume to fewer steps than the run has: refused, the run untouched; to as many: said, nothing trained
    before = tree(copy)
    one_line_error(train(copy, *SMALL, "trainer.total_steps=3", resume=True), 2,
                   f"trainer.total_steps=3 is below step 4, where {copy} already is: a resume only goes forward")
    assert tree(copy) == before
    out = train(copy, *SMALL, resume=True)
    assert out.returncode == 0 and "Step 4: already at trainer.total_steps=4; nothing to train." in out.stdout, out.stderr[-2000:]
    assert fingerprints(copy) == fingerprints(base)
