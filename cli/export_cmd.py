"""`verlj export RUN --rollouts --output FILE`: every generated sample of a run as one table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_USAGE, fail, guarded, quiet_libraries


def export(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The file to write (replaced if it exists).")],
    rollouts: Annotated[bool, typer.Option("--rollouts", help="Export the rollout table: one row per generated sample.")] = False,
    steps: Annotated[Optional[str], typer.Option("--steps", help="START:STOP, inclusive; either may be empty.")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", help="parquet or jsonl (default: from the output's suffix, .parquet or .jsonl).")] = None,
    turns: Annotated[bool, typer.Option("--turns", help="One row per turn of each episode (rollout.env), or per model call of each agent episode (rollout.agent), instead of one per sample.")] = False,
) -> None:
    """Write a run's samples (step, sample id, group, prompt and response as text and ids, rewards, score, whether
    consumed or dropped; an episode's turns, how it ended and its env seed) from the journal and the rollout archive
    alike, for pandas, DuckDB or `datasets`."""
    quiet_libraries()
    from verlj.engine.post_mortem.rollouts import export_rollouts

    if not rollouts:
        raise fail("say what to export: --rollouts (the only table so far)", EXIT_USAGE)
    if fmt is None:
        fmt = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}.get(output.suffix.lower())
        if fmt is None:
            raise fail(f"--output {output}: the rollout table is written as Parquet or JSONL; name the file .parquet or "
                       ".jsonl, or say which with --format", EXIT_USAGE)
    if output.is_dir():
        raise fail(f"--output {output} is a directory; name a file", EXIT_USAGE)
    if not output.parent.is_dir():
        raise fail(f"--output {output}: directory {output.parent} does not exist", EXIT_USAGE)
    written, unit, notes = guarded(lambda: export_rollouts(run, output, fmt, steps, turns))
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {written} {unit} to {output}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
