"""What every command shares: one clear line and an exit code on failure, never a traceback."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

import typer

T = TypeVar("T")

EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_SNAPSHOTS_FAILED = 3  # `verlj train` ran to its end, every step journaled, but snapshots failed


def quiet_libraries() -> None:
    """DeepSpeed and transformers log a lot at INFO, and transformers draws a bar while it loads a model's weights;
    verlj prints its own lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fail(msg: str, code: int = EXIT_DAMAGED) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


INTERRUPTED = "Interrupted: stopped at once."
INTERRUPTED_TRAINING = "Interrupted: stopped at once; the journal holds every step committed so far."


def guarded(fn: Callable[[], T], interrupted: str = INTERRUPTED) -> T:
    """Run fn; turn the errors verlj raises for users (VerljError) into one line and an exit code.
    `interrupted`: what a Ctrl-C says (INTERRUPTED_TRAINING where fn commits steps)."""
    from verlj.journal.errors import VerljError

    try:
        return fn()
    except VerljError as e:
        raise fail(str(e), e.exit_code) from None
    except KeyboardInterrupt:
        typer.echo(interrupted, err=True)
        raise typer.Exit(130) from None
    except OSError as e:
        raise fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e)) from None


def data_stdout() -> Callable[[str], None]:
    """Keep stdout for the command's own output. Libraries print to the process's stdout (DeepSpeed's
    "... built successfully", compilers run by it): from here on file descriptor 1 is stderr, and the
    returned function writes to the real stdout."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def out(line: str) -> None:
        real.write(line + "\n")
        real.flush()

    return out


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def log_to_stderr_only_on_rank0() -> None:
    if not is_rank0():
        sys.stdout = open(os.devnull, "w")
