"""Journals written by the previous release (tests/fixtures/v0: the journal, config and metadata of
three 3–4-step runs, no snapshots) replay to the fingerprints they journaled, and the post-mortem
commands read them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from verlj_testing import fingerprints, verlj

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v0"


# The CPU kernels torch used where the fixtures were written (torch.backends.cpu.get_cpu_capability()). Inferred,
# not recorded by that release: they replay exactly on the machines CI ran on when they were added, and diverge at
# their first step on an AVX2-only machine (an AMD EPYC without AVX-512), whose matrix kernels round differently.
RECORDED_WITH = "AVX512"


@pytest.mark.parametrize("run", ["sync", "stepo", "compl"])
def test_previous_release_journal_replays_exactly(run, tmp_path):
    """Bit-exact where the kernels are the recording's; elsewhere the replay must say it diverged, at the first
    step, in one line (never pass silently, never a traceback)."""
    import torch

    shutil.copytree(FIXTURES / run, tmp_path / run)
    want = fingerprints(tmp_path / run)
    last = max(want)
    if torch.backends.cpu.get_cpu_capability() == RECORDED_WITH:
        out = verlj("replay", tmp_path / run, "--to-step", last, check=True)
        assert f"step {last}: fingerprint {want[last]}" in out.stdout
    else:
        out = verlj("replay", tmp_path / run, "--to-step", last)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith("error: replay diverged at step 1: "), out.stderr[-3000:]
    if run == "sync":  # the post-mortem readers: a step's samples and its held-out eval, the journal's chain
        shown = verlj("inspect", tmp_path / run, "--step", 2, check=True).stdout
        assert "eval" in shown and "samples" in shown
        verlj("journal", "verify", tmp_path / run, check=True)
