"""`verlj verify RUN` (or RUN/step_00150): integrity of the journal and snapshots; `verlj verify DIR --against RUN`: every
row of an SFT or DPO export against the run's journal. Exit 0 intact, 1 damaged (or changed), 2 usage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_USAGE, fail, guarded, quiet_libraries


def verify(
    path: Annotated[Path, typer.Argument(help="A run directory, one snapshot directory (RUN/step_00150), or with --against an "
                                              "export's directory (verlj export --sft/--dpo).")],
    deep: Annotated[bool, typer.Option("--deep", help="Also replay the journal from each snapshot, checking fingerprints.")] = False,
    from_step: Annotated[Optional[int], typer.Option("--from-step", help="With --deep: start replay at this snapshot step.")] = None,
    against: Annotated[Optional[Path], typer.Option("--against", help="PATH is an export: check every row (text, token ids, "
                                                                      "lineage) and file against this run's journal.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
) -> None:
    """Check the journal's chain and checksums and every snapshot's manifest; say whether and how resume can proceed. With
    --against RUN, check that every row of an export is what RUN's journal holds, and name each row that is not."""
    if from_step is not None and not deep:
        raise fail("--from-step chooses where --deep starts replaying; pass --deep with it", EXIT_USAGE)
    quiet_libraries()
    if against is not None:
        return _verify_export(path, against, deep, as_json)
    from verlj.engine.post_mortem.distill_files import is_export

    if path.is_dir() and is_export(path):
        raise fail(f"{path} is an export (verlj export --sft/--dpo); say which run to check its rows against: --against RUN", EXIT_USAGE)
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()  # snapshot files are opened weights-only with torch
    from verlj.engine.post_mortem.verify import render, to_json, verify_run

    if not path.exists():
        raise fail(f"{path} does not exist", EXIT_USAGE)
    report = guarded(lambda: _usage_errors(lambda: verify_run(path, deep=deep, from_step=from_step)))
    typer.echo(to_json(report) if as_json else render(report))
    raise typer.Exit(0 if report.ok else 1)


def _verify_export(path: Path, against: Path, deep: bool, as_json: bool) -> None:
    from verlj.engine.post_mortem.distill_files import read_manifest
    from verlj.engine.post_mortem.distill_verify import render, to_json, verify_export

    if deep:
        raise fail("--deep replays a run; --against checks an export's rows against one: pass one of them", EXIT_USAGE)
    from verlj.engine.loop.ledger import has_run, lost_journal

    for p in (path, against):
        if not p.exists():
            raise fail(f"{p} does not exist", EXIT_USAGE)
    _usage(lambda: read_manifest(path))
    if not has_run(against):
        raise fail(lost_journal(against) or f"--against {against} is not a verlj run (no journal/ with run metadata)", EXIT_USAGE)
    report = guarded(lambda: verify_export(path, against))
    typer.echo(to_json(report) if as_json else render(report))
    raise typer.Exit(0 if report.ok else 1)


def _usage(fn):
    from verlj.journal.errors import VerljError

    try:
        return fn()
    except VerljError as e:  # not an export at all: bad usage
        raise fail(str(e), EXIT_USAGE) from None


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
