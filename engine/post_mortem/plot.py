"""`verlj metrics RUN --plot out.png`: one panel per metric, with snapshot and resume markers."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import UsageError
from ..loop.ledger import open_run


def _points(rows: list[dict], name: str) -> list[tuple[int, float]]:
    """(step, value) of the metric `name` in metrics.metric_rows' rows, where the step has it."""
    return [(r["step"], r[name]) for r in rows if r.get(name) is not None]


def plot_metrics(run_dir: Path, cols: list[str], rows: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib, which the default install leaves out: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open_run(run_dir) as ledger:
        snaps = sorted(ledger.snapshots.index())
        resumes = ledger.lineage.resume_steps()
    n = max(1, len(cols))
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 * n), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], cols):
        # a metric only some steps have (the held-out eval every N steps) is drawn through its points
        have = _points(rows, name)
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


CLIPPED = "whatif/is_clipped_frac"  # the share of its tokens past the importance-weight threshold


def plot_compare(run_a: Path, others: list[Path], names: list[str] | None, steps: str | None, out: Path, choose=None) -> list[int | None]:
    """`verlj metrics RUN NEW [NEW2 …] --plot out.png`: every run's curves on each panel (`names`, else
    `choose(the metric names all runs have)`), a line at the first step where each other run's
    fingerprints part from RUN's, and panels of each what-if's drift and clipped share when any run is
    one. Returns each other run's parting step (None: it never parts)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib, which the default install leaves out: pip install matplotlib") from None
    from .metrics import metric_rows

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [Path(run_a), *map(Path, others)]
    loaded = [metric_rows(r, None, steps) for r in runs]
    common = [c for c in loaded[0][0] if all(c in set(cols) for cols, _ in loaded[1:])]
    cols = names or (choose(common) if choose else common[:6])
    known = set().union(*(set(cols) for cols, _ in loaded))
    unknown = [c for c in cols if c not in known]
    if unknown:
        raise UsageError(f"unknown metric {unknown[0]!r}; the runs have: {', '.join(common)}")
    prints = []
    for r in runs:
        with open_run(r) as ledger:
            prints.append(ledger.fingerprints())
    fa = prints[0]
    parted = [next((s for s in sorted(set(fa) & set(fb)) if fa[s] != fb[s]), None) for fb in prints[1:]]
    extra = [m for m in (DRIFT, CLIPPED) if m not in cols and any(r.get(m) is not None for _, rows in loaded for r in rows)]
    panels = [*cols, *extra]
    labels = [r.name for r in runs]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    # one other run: its parting line is red; several: each in its run's colour
    part_colors = ["tab:red"] if len(others) == 1 else colors[1:]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.0 * len(panels)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], panels):
        for i, (label, (_, rows)) in enumerate(zip(labels, loaded)):
            have = _points(rows, name)
            if have:
                ax.plot([s for s, _ in have], [y for _, y in have], ls="-" if i == 0 else "--", lw=1.2, color=colors[i], label=label)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
        for p, c in zip(parted, part_colors):
            if p is not None:
                ax.axvline(p, color=c, ls=":", lw=0.9)
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    if len(others) == 1:
        said = f"they part at step {parted[0]} (red dotted)" if parted[0] is not None else "the same state at every common step"
        title = f"{labels[0]} vs {labels[1]}: {said}"
    else:
        title = f"{labels[0]} vs " + ", ".join(
            f"{label} (parts at {p})" if p is not None else f"{label} (never parts)" for label, p in zip(labels[1:], parted)
        ) + "; dotted lines: where each parts"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return parted
