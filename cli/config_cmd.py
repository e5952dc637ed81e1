"""`verlj config show`: the effective config (built-in default <- --config file <- overrides) as YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import guarded

config_app = typer.Typer(help="Inspect configuration.", no_args_is_help=True)


@config_app.command("show")
def show(
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, e.g. algorithm.name=ppo.")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file.")] = None,
) -> None:
    """Print the effective config as YAML (and its hash as a comment)."""
    from verlj.engine.config import make_config, to_yaml

    cfg = guarded(lambda: make_config(config, list(overrides or [])))
    typer.echo(f"# config_hash: {cfg.hash()}")
    typer.echo(to_yaml(cfg), nl=False)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
