"""`verlj verify RUN` (or RUN/step_00150): integrity of the journal and snapshots. Exit 0 intact, 1 damaged, 2 usage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_USAGE, fail, guarded, quiet_libraries


def verify(
    path: Annotated[Path, typer.Argument(help="A run directory, or one snapshot directory (RUN/step_00150).")],
    deep: Annotated[bool, typer.Option("--deep", help="Also replay the journal from each snapshot, checking fingerprints.")] = False,
    from_step: Annotated[Optional[int], typer.Option("--from-step", help="With --deep: start replay at this snapshot step.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
) -> None:
    """Check the journal's chain and checksums and every snapshot's manifest; say whether and how resume can proceed."""
    if from_step is not None and not deep:
        raise fail("--from-step chooses where --deep starts replaying; pass --deep with it", EXIT_USAGE)
    quiet_libraries()
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()  # snapshot files are opened weights-only with torch
    from verlj.engine.post_mortem.verify import render, to_json, verify_run

    if not path.exists():
        raise fail(f"{path} does not exist", EXIT_USAGE)
    report = guarded(lambda: _usage_errors(lambda: verify_run(path, deep=deep, from_step=from_step)))
    typer.echo(to_json(report) if as_json else render(report))
    raise typer.Exit(0 if report.ok else 1)


def _usage_errors(fn):
    from verlj.journal import NotAJournalError

    try:
        return fn()
    except NotAJournalError as e:  # not a run at all: bad usage. Damage is reported, exit 1.
        raise fail(str(e), EXIT_USAGE) from None


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
    # the spelling of the verl rollback tutorial users come from: `verlj checkpoint verify PATH`
    checkpoint = typer.Typer(help="Snapshot commands, as the verl tutorial spells them.", no_args_is_help=True)
    checkpoint.command("verify", help="The same as `verlj verify`.")(verify)
    app.add_typer(checkpoint, name="checkpoint")
