"""`verlj train`: run (or resume) RL post-training.

    verlj train --output-dir runs/demo
    verlj train --config ppo_config.yaml --output_dir ./checkpoints algorithm.name=ppo trainer.total_steps=40
    verlj train --output-dir runs/demo --resume trainer.total_steps=80
    verlj train --output-dir runs/demo trainer.max_restarts=3      # restarted with --resume when it dies
    torchrun --nproc_per_node 2 -m verlj.cli train --output-dir runs/dp2 distributed.zero_stage=3
    verlj train --launcher ray --nproc 2 --output-dir runs/dp2 trainer.max_restarts=3   # ranks as Ray actors (cli/ray_launch.py)
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_SNAPSHOTS_FAILED, EXIT_USAGE, INTERRUPTED_TRAINING, fail, guarded, log_to_stderr_only_on_rank0, quiet_libraries
from .supervise import STANDBY, SUPERVISED, supervise, under_launcher


class Launcher(str, Enum):
    process = "process"  # this process trains: one rank, or one of torchrun's
    ray = "ray"  # --nproc ranks as Ray actors in a placement group (cli/ray_launch.py)


def train(
    output_dir: Annotated[Path, typer.Option("--output-dir", "--output_dir", "-o", help="Run directory (journal, snapshots, logs).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted config overrides, e.g. trainer.total_steps=40.")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --output-dir from its last committed step.")] = False,
    allow_config_change: Annotated[
        bool, typer.Option("--allow-config-change", help="On resume, accept (and record) changes to state-shaping keys.")
    ] = False,
    launcher: Annotated[
        Launcher, typer.Option("--launcher", help="process: this process trains (one rank, or one of torchrun's); ray: --nproc "
                               "ranks as Ray actors in a placement group (pip install 'verlj[ray]'; in a checkout: pip install -e '.[ray]').")
    ] = Launcher.process,
    nproc: Annotated[Optional[int], typer.Option("--nproc", min=1, help="With --launcher ray: the number of ranks (default 1).")] = None,
) -> None:
    """Train with GRPO, RLOO, REINFORCE++ or PPO; every step is journaled, snapshots are taken every save_interval steps."""
    quiet_libraries()
    log_to_stderr_only_on_rank0()
    from verlj.engine.config import restarts_asked

    overrides = list(overrides or [])
    if any(o == "trainer.resume_from=auto" or o.startswith("trainer.resume_from=") for o in overrides):
        resume = True
    restarts = guarded(lambda: restarts_asked(config, overrides))
    if launcher is Launcher.ray or nproc is not None:
        if launcher is not Launcher.ray:
            raise fail("--nproc is the number of ranks --launcher ray starts (under torchrun: --nproc_per_node)", EXIT_USAGE)
        if under_launcher():
            raise fail("--launcher ray starts the ranks itself: run it without torchrun", EXIT_USAGE)
        from .ray_launch import launch

        raise typer.Exit(launch(output_dir, config, overrides, resume, allow_config_change, nproc or 1, restarts, train))
    if restarts and os.environ.get(SUPERVISED) != "1":
        if not under_launcher():
            argv = [sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(output_dir), *(["--config", str(config)] if config else []),
                    *(["--resume"] if resume else []), *(["--allow-config-change"] if allow_config_change else []), *overrides]
            raise typer.Exit(supervise(argv, restarts))
        if os.environ.get("RANK", "0") == "0" and not os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip("0"):
            typer.echo(f"verlj: trainer.max_restarts={restarts} is not applied under torchrun: its ranks are restarted by "
                       f"`torchrun --max-restarts {restarts}` (each restart resumes by itself)", err=True)
    if not resume and (restart := os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")).isdigit() and int(restart) > 0:
        resume = True  # torchrun --max-restarts started this rank again: the run goes on from its journal
        if os.environ.get("RANK", "0") == "0":
            typer.echo(f"verlj: torchrun restart {restart}: resuming the run in {output_dir}", err=True)
    prebuilt = None
    if os.environ.pop(STANDBY, None) == "1":
        told, prebuilt = ready_when_told(config, overrides)
        if not told:
            return  # a standby the supervisor did not need
    from verlj.engine.loop.run import train as run_train  # torch and DeepSpeed: not in a supervisor

    done = guarded(lambda: run_train(output_dir, config, overrides, resume=resume, allow_config_change=allow_config_change,
                                     prebuilt=prebuilt), INTERRUPTED_TRAINING)
    typer.echo(f"Done: last committed step {done.last} in {output_dir}")
    if done.snapshots_failed:  # the run is whole, but a scheduler must see that its snapshots are not
        typer.echo(f"Snapshots failed: {done.snapshots_failed}")
        raise typer.Exit(EXIT_SNAPSHOTS_FAILED)


def ready_when_told(config: Path | None, overrides: list[str]):
    """A standby (cli/supervise.py): import what training needs now and, where it can, build the trainer for the
    command's config (loop.standby), then wait for the supervisor's "go" on stdin. Returns (whether it came:
    False when stdin closes without it, the prebuilt trainer or None)."""
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()  # before DeepSpeed is imported, as a run does
    import deepspeed  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    from verlj.engine.loop import checkpointer, recovery, run  # noqa: F401
    from verlj.engine.loop.standby import prebuild
    from verlj.engine.rl import trainer  # noqa: F401

    prebuilt = prebuild(config, overrides, lambda line: typer.echo(f"verlj: {line}", err=True))
    return sys.stdin.readline().strip() == "go", prebuilt


def register(app: typer.Typer) -> None:
    app.command("train", epilog="Every config key with its default: verlj config show. A key's comment in "
                "engine/config.py says what it does and whether it may change on --resume.")(train)
