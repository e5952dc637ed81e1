"""verlj command line. `verlj --help` lists the commands; each lives in its own module."""

from __future__ import annotations

import sys
from importlib.metadata import version
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="verlj",
    help="RL post-training on DeepSpeed whose state can be brought back to any completed step, exactly.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: flags show as flags, defaults as [default: ...]
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"verlj {version('verlj')}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    pass


def _register() -> None:
    from . import config_cmd, export_cmd, inspect_cmd, journal_cmd, replay_cmd, train_cmd, verify_cmd

    train_cmd.register(app)
    replay_cmd.register(app)
    verify_cmd.register(app)
    inspect_cmd.register(app)
    config_cmd.register(app)
    journal_cmd.register(app)
    export_cmd.register(app)


_register()


def main() -> None:
    try:
        app()
    except SystemExit as done:
        if not done.code:  # after a failure a peer may still sit in a collective: leave teardown to the exit
            _leave_process_group()
        raise


def _leave_process_group() -> None:
    if "torch.distributed" in sys.modules:  # only commands that started a group imported it
        from verlj.engine.dist import teardown

        teardown()


if __name__ == "__main__":
    main()
