"""Journals written by the previous release (tests/fixtures/v0: the journal, config and metadata of
three 3–4-step runs, no snapshots) replay to the fingerprints they journaled, and the post-mortem
commands read them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from verlj_testing import fingerprints, verlj

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v0"


@pytest.mark.parametrize("run", ["sync", "stepo", "compl"])
def test_previous_release_journal_replays_exactly(run, tmp_path):
    shutil.copytree(FIXTURES / run, tmp_path / run)
    want = fingerprints(tmp_path / run)
    last = max(want)
    out = verlj("replay", tmp_path / run, "--to-step", last, check=True)
    assert f"step {last}: fingerprint {want[last]}" in out.stdout
    if run == "sync":  # the post-mortem readers: a step's samples and its held-out eval, the journal's chain
        shown = verlj("inspect", tmp_path / run, "--step", 2, check=True).stdout
        assert "eval" in shown and "samples" in shown
        verlj("journal", "verify", tmp_path / run, check=True)
