"""`verlj metrics RUN --plot out.png`: one panel per metric, with snapshot and resume markers."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import RunError
from ..loop.ledger import open_run


def plot_metrics(run_dir: Path, cols: list[str], rows: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RunError("--plot needs matplotlib, which the default install leaves out: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open_run(run_dir) as ledger:
        snaps = sorted(ledger.snapshots())
        resumes = ledger.resume_steps()
    n = max(1, len(cols))
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 * n), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], cols):
        # a metric only some steps have (the held-out eval every N steps) is drawn through its points
        have = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        sparse = len(have) < len(rows)
        ax.plot([s for s, _ in have], [math.nan if y is None else y for _, y in have], lw=1.2, marker="o" if sparse else None, ms=3)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
        for s in snaps:
            ax.axvline(s, color="tab:green", ls=":", lw=0.8)
        for s in resumes:
            ax.axvline(s, color="tab:red", ls="--", lw=0.8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{Path(run_dir).name}: green dotted = snapshot, red dashed = resume", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
