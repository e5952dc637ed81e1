"""Journals written by the previous release (tests/fixtures/v0: the journal, config and metadata of
three 3–4-step runs, no snapshots) replay to the fingerprints they journaled, and the post-mortem
commands read them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from verlj_testing import cli, fingerprints, verlj

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v0"


# How close a step-1 log-prob computed on other kernels comes to the recording's: matrix kernels that round differently
# (another instruction set, or another processor at the same level: an AVX2-only AMD EPYC, a 5th-generation Xeon, against
# the machine that wrote the fixtures) move the mean by about 1e-9 of itself; a change of what is computed moves it far more.
ROUNDING = 1e-6


@pytest.mark.parametrize("run", ["sync", "stepo", "compl"])
def test_previous_release_journal_replays_exactly(run, tmp_path):
    """Bit-exact where this machine's kernels compute as the recording's did; elsewhere the replay must say it diverged,
    at the first step, in one line (never pass silently, never a traceback), and step 1 rerun from the initial state must
    differ from the journal only by rounding, in its first stage, the old log-probs (the fixtures do not record their
    machine: this tells another machine's kernels from a change of what is computed)."""
    import json

    shutil.copytree(FIXTURES / run, tmp_path / run)
    want = fingerprints(tmp_path / run)
    last = max(want)
    out = verlj("replay", tmp_path / run, "--to-step", last)
    if out.returncode == 0:
        assert f"step {last}: fingerprint {want[last]}" in out.stdout
    else:
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith("error: replay diverged at step 1: "), out.stderr[-3000:]
        probe = json.loads(verlj("rerun", tmp_path / run, "--steps", "1:1", "--json").stdout)["verdicts"][0]
        was, now = probe["journaled"], probe["rerun"]
        assert probe["stage"] == "old_logprobs" and was["n"] == now["n"], probe
        assert abs(was["mean"] - now["mean"]) <= ROUNDING * abs(was["mean"]) and abs(was["absmax"] - now["absmax"]) <= ROUNDING * was["absmax"], probe
    if run == "sync":  # the post-mortem readers: a step's samples and its held-out eval, the journal's chain
        shown = verlj("inspect", tmp_path / run, "--step", 2, check=True).stdout
        assert "eval" in shown and "samples" in shown
        verlj("journal", "verify", tmp_path / run, check=True)


# `export --rollouts` of each fixture as JSONL, sha256, as verlj wrote it before samples could be episodes
# (commit 1e74618): a single-turn run's table must stay byte for byte what it was
EXPORTED = {"sync": "858572226fe79bd434d855acb502c71dc92ef9574fe2ed36c25a119dac1662cd",
            "stepo": "b5ac4306f4db41731a9ec0f4e20546d3ec2596eeb01e9172b6f6dd25bab62a70",
            "compl": "c5638e1fb49a7aa48e47ae586e4c3329b5815f76433c7be94e1e0019b19aad5e"}


@pytest.mark.parametrize("run", sorted(EXPORTED))
def test_single_turn_export_is_byte_for_byte_what_it_was(run, tmp_path):
    shutil.copytree(FIXTURES / run, tmp_path / run)
    cli("export", tmp_path / run, "--rollouts", "-o", tmp_path / "r.jsonl", check=True)
    assert hashlib.sha256((tmp_path / "r.jsonl").read_bytes()).hexdigest() == EXPORTED[run]
    pq = pytest.importorskip("pyarrow.parquet")
    cli("export", tmp_path / run, "--rollouts", "-o", tmp_path / "r.parquet", check=True)
    assert "turns" not in pq.read_schema(tmp_path / "r.parquet").names
