"""`verlj journal ...`: low-level journal commands (verify a journal directory, print a record)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verlj.journal import JournalError, open_journal_reader, verify_journal

journal_app = typer.Typer(help="Low-level journal commands.", no_args_is_help=True)


@journal_app.command("verify")
def verify(path: Annotated[Path, typer.Argument(help="A journal directory (RUN/journal, with the LMDB files or shipped segments), "
                                                    "or the run directory that holds it.")]) -> None:
    """Check a journal's chain, checksums, step continuity, schemas and LMDB structure."""
    if (path / "journal").is_dir():  # a run directory: a journal directory never holds one named so
        path = path / "journal"
    try:
        with open_journal_reader(path) as journal:
            report = verify_journal(journal)
    except JournalError as e:
        from verlj.engine.loop.ledger import lost_journal

        lost = lost_journal(path)  # a run directory whose journal/ is gone: say so, as `verlj verify` does
        typer.echo(f"error: {lost or e}", err=True)
        raise typer.Exit(1 if lost else 2) from None
    for p in report.problems:
        typer.echo(f"✗ {p}")
    if report.ok:
        typer.echo(f"✓ journal intact: steps {report.first_step}–{report.last_step} ({report.steps} records)")
        if report.pruned:
            typer.echo(f"· the samples of {report.pruned} steps through step {report.pruned_through} were pruned by retention")
    raise typer.Exit(0 if report.ok else 1)


def register(app: typer.Typer) -> None:
    app.add_typer(journal_app, name="journal")
