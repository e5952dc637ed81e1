"""Where a command writes what a user asked for (an export, a plot, a replayed model or snapshot): never into a
run's directory, and into folders made as needed.

    verlj export runs/demo --sft -o out/sft          # out/ made if missing
    verlj export runs/demo --rollouts -o runs/demo/metrics.jsonl   # refused: it would replace the run's own file

A run's directory is verlj's (its journal, snapshots, config.yaml, metrics.jsonl, ...): a file written there could
replace one of the run's own, or be taken for one (a directory named like a snapshot), so any path inside one,
whichever run it is, is refused before anything is read, in one line, exit 2 (a wrong argument).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..loop.ledger import run_holding


def check_output(flag: str, path: Path) -> None:
    """A UsageError when `path` is a run's directory or lies inside one."""
    held = run_holding(path)
    if held is None:
        return
    where = "is the run directory" if held == Path(path).resolve() else f"is inside the run directory {held}"
    raise UsageError(f"{flag} {path} {where}: verlj never writes what a command makes into a run, where it could replace or be "
                     "taken for one of the run's own files; name a path outside it")


def make_parent(path: Path) -> list[Path]:
    """Make the folders `path` goes into that are missing; returns those made (innermost first), for `remove_made`."""
    made = []
    for d in [Path(path).parent, *Path(path).parent.parents]:
        if d.exists():
            break
        made.append(d)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the folders `make_parent` made, those still empty (a command that failed leaves nothing behind)."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            break
