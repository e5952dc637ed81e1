"""`verlj metrics RUN [NEW …] --plot out.png` (engine/post_mortem/plot.py), on copies of the release-0 journals kept
as fixtures (tests/fixtures/v0: `sync`, and `stepo`, the same task in async step order): a panel a metric, each
drawn; beside another run, where their fingerprints part. The command on a trained run:
tests/integration/test_verify_inspect.py.

    python -m pytest -n 0 tests/unit/test_plot.py
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from verlj.engine.post_mortem.metrics import metric_rows
from verlj.engine.post_mortem.plot import plot_compare, plot_metrics
from verlj.journal import open_journal_reader
from verlj_testing import REPO

FIXTURES = REPO / "tests" / "fixtures" / "v0"


@pytest.fixture
def runs(tmp_path):
    for name in ("sync", "stepo"):  # copies: a reader leaves a lock file beside data.mdb
        shutil.copytree(FIXTURES / name, tmp_path / name)
    shutil.copytree(FIXTURES / "sync", tmp_path / "again")
    return tmp_path


def image(png):
    import matplotlib.image as mpimg

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(png)


def test_one_panel_a_metric_each_drawn(runs):
    names = ["actor/pg_loss", "critic/score/mean"]
    cols, rows = metric_rows(runs / "sync", names, None)
    assert cols == names and len(rows) >= 2
    plot_metrics(runs / "sync", cols, rows, runs / "m.png")
    img = image(runs / "m.png")
    assert img.shape[:2] == (round(2 * 2.2 * 90), 9 * 90)  # two stacked panels at 90 dpi
    assert float(np.std(img[..., :3])) > 0.05  # not blank


def test_beside_another_run_the_plot_says_where_they_part(runs):
    def fingerprints(run):
        with open_journal_reader(run / "journal") as j:
            return {s: e["fingerprint"] for s, e in j.iter_events("state")}

    a, b = fingerprints(runs / "sync"), fingerprints(runs / "stepo")
    parts = next(s for s in sorted(set(a) & set(b)) if a[s] != b[s])
    assert plot_compare(runs / "sync", [runs / "stepo", runs / "again"], ["actor/pg_loss"], None, runs / "c.png") == [parts, None]
    assert image(runs / "c.png").shape[:2] == (round(2.0 * 90), 9 * 90)
