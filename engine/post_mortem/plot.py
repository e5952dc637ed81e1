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


DRIFT = "whatif/drift/mean"  # a what-if's drift from the policy that generated (loop.whatif)


def plot_compare(run_a: Path, run_b: Path, names: list[str] | None, steps: str | None, out: Path, choose=None) -> int | None:
    """`verlj metrics RUN NEW --plot out.png`: both runs' curves on each panel (`names`, else
    `choose(common metric names)`), a line at the first step whose fingerprints differ, and a panel
    of the what-if's drift when either run is one. Returns that first step (None: they never part)."""
    try:
        import matplotlib
    except ImportError:
        raise RunError("--plot needs matplotlib, which the default install leaves out: pip install matplotlib") from None
    from .inspection import metric_rows

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (cols_a, rows_a), (cols_b, rows_b) = metric_rows(run_a, None, steps), metric_rows(run_b, None, steps)
    common = [c for c in cols_a if c in set(cols_b)]
    cols = names or (choose(common) if choose else common[:6])
    unknown = [c for c in cols if c not in set(cols_a) | set(cols_b)]
    if unknown:
        raise RunError(f"unknown metric {unknown[0]!r}; the runs have: {', '.join(common)}")
    with open_run(run_a) as la, open_run(run_b) as lb:
        fa, fb = la.fingerprints(), lb.fingerprints()
    parted = next((s for s in sorted(set(fa) & set(fb)) if fa[s] != fb[s]), None)
    drift = [(r["step"], r[DRIFT], label) for label, rows in ((Path(run_a).name, rows_a), (Path(run_b).name, rows_b))
             for r in rows if r.get(DRIFT) is not None]
    panels = [*cols, DRIFT] if drift and DRIFT not in cols else cols
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], panels):
        for label, rows, style in ((Path(run_a).name, rows_a, "-"), (Path(run_b).name, rows_b, "--")):
            have = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if have:
                ax.plot([s for s, _ in have], [y for _, y in have], ls=style, lw=1.2, label=label)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
        if parted is not None:
            ax.axvline(parted, color="tab:red", ls=":", lw=0.9)
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    said = f"they part at step {parted} (red dotted)" if parted is not None else "the same state at every common step"
    fig.suptitle(f"{Path(run_a).name} vs {Path(run_b).name}: {said}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return parted
