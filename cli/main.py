"""verlj command line. `verlj --help` lists the commands; each lives in its own module."""

from __future__ import annotations

import atexit
import os
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
    from . import config_cmd, export_cmd, inspect_cmd, journal_cmd, replay_cmd, rerun_cmd, train_cmd, verify_cmd, view_cmd, whatif_cmd

    train_cmd.register(app)
    replay_cmd.register(app)
    rerun_cmd.register(app)
    whatif_cmd.register(app)
    verify_cmd.register(app)
    inspect_cmd.register(app)
    config_cmd.register(app)
    journal_cmd.register(app)
    export_cmd.register(app)
    view_cmd.register(app)


_register()


def main() -> None:
    try:
        app()
    except SystemExit as done:
        if not done.code:  # after a failure a peer may still sit in a collective: leave teardown to the exit
            _leave_process_group()
        raise


def _leave_process_group() -> None:
    """After a command that started a process group succeeded: destroy the group, run the exit
    handlers, flush, and end the process without the interpreter's own finalization. gloo's worker
    threads can still free their last tensors while C++ static objects are destroyed at exit, and the
    process then dies of SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489)
    after its work is done; destroying the group first made that rare, not impossible (1 in 9 runs of a
    2-rank TP export), so a successful command does not go through that finalization at all."""
    if "torch.distributed" not in sys.modules:  # only commands that started a group imported it
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from verlj.engine.dist import teardown

    teardown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
