"""`verlj view RUN [RUN ...]`: the runs in a browser (engine/post_mortem/view)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import guarded, quiet_libraries


def view(
    runs: Annotated[list[Path], typer.Argument(help="Run directories; the first two are compared at /compare.")],
    port: Annotated[int, typer.Option("--port", help="The port to serve on (0: any free one).")] = 8765,
    host: Annotated[str, typer.Option("--host", help="The address to serve on; other than the loopback only with --token.")] = "127.0.0.1",
    token: Annotated[Optional[str], typer.Option("--token", help="A secret every request must carry (8 or more of A-Z a-z 0-9 . _ ~ -; the printed URL has it).")] = None,
) -> None:
    """A read-only web UI for runs, live while they train: curves, every step's samples and episodes, the
    first divergent step of two runs, search. Prints the URL; Ctrl-C stops it."""
    quiet_libraries()
    import signal

    from verlj.engine.post_mortem.view import serve

    # Ctrl-C is how it stops, even where the shell started it with SIGINT ignored (a background job of a
    # script inherits SIG_IGN, and Python then raises no KeyboardInterrupt); SIGTERM stops it the same way
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def stopped():
        try:
            serve(runs, host, port, token, typer.echo)
        except KeyboardInterrupt:
            typer.echo("stopped")

    guarded(stopped)


def register(app: typer.Typer) -> None:
    app.command("view")(view)
