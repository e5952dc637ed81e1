"""`verlj rerun RUN --steps A:B`: re-execute journaled steps here and compare every stage with the journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import data_stdout, fail, guarded, is_rank0, log_to_stderr_only_on_rank0, quiet_libraries


def rerun(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    steps: Annotated[str, typer.Option("--steps", help="A:B, inclusive (or one step).")],
    as_json: Annotated[bool, typer.Option("--json", help="The verdicts as JSON (the only thing on stdout).")] = False,
    rescore_model: Annotated[bool, typer.Option("--rescore-model", help="Score the samples with the reward model again too "
                                                "(a forward pass per sample); else its journaled scores are kept.")] = False,
) -> None:
    """Re-execute steps A..B from the nearest snapshot, the samples scored again with the reward
    function the config names as it is now, and compare every stage digest with the journal:
    reproduced, or where it differs, transient or persistent. Exit 0 when every step reproduced,
    1 otherwise. Writes nothing into the run."""
    quiet_libraries()
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()
    log_to_stderr_only_on_rank0()
    out = data_stdout()
    from verlj.engine.post_mortem import rerun as rr

    if not run.is_dir():
        raise fail(f"{run} does not exist", 2)
    start, stop = guarded(lambda: rr.parse_steps(steps))
    report = guarded(lambda: rr.rerun(run, start, stop, rescore_model))
    if is_rank0():
        out(json.dumps(report.to_dict()) if as_json else rr.render(report))
    raise typer.Exit(0 if report.reproduced else 1)


def register(app: typer.Typer) -> None:
    app.command("rerun")(rerun)
