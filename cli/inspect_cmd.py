"""Post-mortem commands: `verlj inspect`, `verlj metrics`, `verlj find`, `verlj diff`."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_USAGE, data_stdout, fail, guarded, quiet_libraries


def _jsonable(x):
    return json.loads(json.dumps(x, default=str, allow_nan=True))


def inspect(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    step: Annotated[Optional[int], typer.Option("--step", help="Show everything journaled at this step.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    max_samples: Annotated[Optional[int], typer.Option("--max-samples", help="With --step: show at most this many samples.")] = None,
) -> None:
    """A run's summary, or (--step N) its step N: data, seeds, buffer changes, samples as text, metrics, fingerprint."""
    quiet_libraries()
    from verlj.engine.post_mortem import inspection

    if step is None:
        s = guarded(lambda: inspection.run_summary(run))
        typer.echo(json.dumps(_jsonable(s.to_json()), indent=2) if as_json else inspection.render_summary(s))
    else:
        d = guarded(lambda: inspection.step_detail(run, step, max_samples))
        typer.echo(json.dumps(_jsonable(d.to_json()), indent=2) if as_json else inspection.render_step(d))


def metrics(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    others: Annotated[Optional[list[Path]], typer.Argument(help="With --plot: other runs (what-ifs, forks) drawn beside the first.")] = None,
    names: Annotated[Optional[str], typer.Option("--names", help="Comma-separated metric names (default: all).")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help="START:STOP, inclusive; either may be empty.")] = None,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV to stdout.")] = False,
    as_jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON object per step to stdout.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: one panel per metric, snapshot and resume markers.")] = None,
) -> None:
    """Metrics per step as a table, CSV, JSONL or a plot; several runs side by side on one plot."""
    quiet_libraries()
    from verlj.engine.post_mortem import metrics

    chosen = [flag for flag, on in (("--csv", as_csv), ("--jsonl", as_jsonl), ("--plot", plot is not None)) if on]
    if len(chosen) > 1:
        raise fail(f"{' and '.join(chosen)} each choose the output; pass one", EXIT_USAGE)
    if plot is not None and plot.is_dir():
        raise fail(f"--plot {plot} is a directory; name a .png file", EXIT_USAGE)
    if plot is not None:
        from verlj.engine.post_mortem.outputs import check_output, make_parent

        guarded(lambda: check_output("--plot", plot))
        make_parent(plot)

    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    if others:
        if plot is None:
            raise fail("a second run is drawn beside the first with --plot out.png only", 2)
        from verlj.engine.post_mortem.plot import plot_compare

        parted = guarded(lambda: plot_compare(run, others, wanted, steps, plot, _default_plot_cols))
        if len(others) == 1:
            typer.echo(f"wrote {plot} ({'the runs part at step ' + str(parted[0]) if parted[0] is not None else 'the runs never part'})")
        else:
            said = [f"{o.name} parts at step {p}" if p is not None else f"{o.name} never parts" for o, p in zip(others, parted)]
            typer.echo(f"wrote {plot} ({'; '.join(said)})")
        return
    cols, rows = guarded(lambda: metrics.metric_rows(run, wanted, steps))
    if plot is not None:
        from verlj.engine.post_mortem.plot import plot_metrics

        guarded(lambda: plot_metrics(run, cols if wanted else _default_plot_cols(cols), rows, plot))
        typer.echo(f"wrote {plot}")
        return
    if as_csv:
        w = csv.writer(sys.stdout)
        w.writerow(["step", *cols])
        for r in rows:
            w.writerow([r["step"], *[r.get(c, "") for c in cols]])
    elif as_jsonl:
        for r in rows:
            typer.echo(json.dumps(r, allow_nan=True))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(show_edge=False, box=None)
        for c in ["step", *cols]:
            t.add_column(c, justify="right", no_wrap=True)
        for r in rows:
            t.add_row(str(r["step"]), *[_fmt(r.get(c)) for c in cols])
        # wide enough for every name whole: cut to fit, critic/score/mean, /max and /min all read "critic/scor…"
        Console(width=max(100, sum(max(len(c), 12) + 1 for c in ["step", *cols]) + 1)).print(t)


def _fmt(v) -> str:
    if v is None:
        return ""
    return "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.6g}"


def _default_plot_cols(cols: list[str]) -> list[str]:
    pref = ["critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean", "actor/ppo_kl"]
    return [c for c in pref if c in cols] or cols[:6]


def find(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    where: Annotated[str, typer.Option("--where", help="e.g. 'actor/grad_norm > 10', 'actor/pg_loss is nan'; join with 'and'.")],
    limit: Annotated[Optional[int], typer.Option("--limit", help="Stop after this many matches.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The steps whose metrics match a condition, first one first."""
    quiet_libraries()
    from verlj.engine.post_mortem import metrics

    hits = guarded(lambda: metrics.find_steps(run, where, limit))
    if as_json:
        typer.echo(json.dumps([m.to_json() for m in hits], allow_nan=True))
        return
    if not hits:
        typer.echo(f"no step matches {where!r}")
        return
    typer.echo(f"{len(hits)} step(s) match {where!r}; first: {hits[0].step}")
    for m in hits:
        typer.echo(f"  step {m.step}: " + "  ".join(f"{k}={_fmt(x)}" for k, x in m.values.items()))


def diff(
    run_a: Annotated[Path, typer.Argument(help="First run directory.")],
    run_b: Annotated[Path, typer.Argument(help="Second run directory.")],
    full: Annotated[bool, typer.Option("--full", help="Also compare every step's samples (slower).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    strict_env: Annotated[bool, typer.Option("--strict-env", help="Exit 1 also when only the environment differs (library "
                                                                 "versions, verlj's source), every step alike.")] = False,
    stages: Annotated[bool, typer.Option("--stages", help="Where the first differing stage is journaled as a digest only, "
                                                          "re-execute both runs' step to name the first differing element.")] = False,
) -> None:
    """The first step where two runs' journals differ, and what differs there. Exit 1 if they differ; a
    difference in library versions alone is named and exits 0 (--strict-env: 1)."""
    quiet_libraries()
    from verlj.engine.post_mortem import diff as differ

    echo: Callable[[str], None] = typer.echo
    compare = differ.first_difference
    if stages:  # the re-execution loads DeepSpeed, which prints: stdout stays this command's
        from verlj.engine.dist import prepare_accelerator

        prepare_accelerator()
        echo = data_stdout()
        from verlj.engine.post_mortem.rerun import diff_stages as compare
    d = guarded(lambda: compare(run_a, run_b, full))
    echo(json.dumps(_jsonable(d.to_json()), indent=2) if as_json else differ.render_diff(d, run_a, run_b))
    raise typer.Exit(0 if d.identical and not (strict_env and d.environment) else 1)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)
    app.command("metrics")(metrics)
    app.command("find")(find)
    app.command("diff")(diff)


__all__ = ["EXIT_USAGE", "fail", "register"]
