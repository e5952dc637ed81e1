"""`verlj replay RUN --to-step N`: the exact state after step N, from the nearest valid snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import INTERRUPTED_TRAINING, data_stdout, fail, guarded, log_to_stderr_only_on_rank0, quiet_libraries


def replay(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    to_step: Annotated[Optional[int], typer.Option("--to-step", help="The completed step to bring back.")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help="With --probe: A:B, the steps to measure.")] = None,
    probe: Annotated[Optional[str], typer.Option("--probe", help="module:function(step, batch, model) -> {name: number}, "
                                                                 "called before each of --steps (one JSON line a step; "
                                                                 "stored as probe/<module.function>/<name>).")] = None,
    workers: Annotated[int, typer.Option("--workers", help="With --probe: split --steps at snapshots over this many processes.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print {step, fingerprint, from_snapshot} as JSON (the only thing on stdout).")] = False,
    export: Annotated[Optional[Path], typer.Option("--export", help="Write the actor as a Hugging Face model directory (new or empty).")] = None,
    export_adapter: Annotated[Optional[Path], typer.Option("--export-adapter", help="LoRA: write the adapters as a PEFT adapter directory (new or empty).")] = None,
    snapshot: Annotated[Optional[Path], typer.Option("--snapshot", help="Write the state as a verlj snapshot directory (new or empty).")] = None,
    fork: Annotated[Optional[Path], typer.Option("--fork", help="Start a new run from this state in NEW_RUN (new or empty).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(help="With --fork: config overrides for the new run.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what recovery does (on stderr).")] = False,
) -> None:
    """Load the newest valid snapshot <= N, replay the journal to N checking every fingerprint, print it."""
    quiet_libraries()
    from verlj.engine.dist import prepare_accelerator

    prepare_accelerator()
    log_to_stderr_only_on_rank0()
    out = data_stdout()  # what this command prints for people or tools; everything else goes to stderr
    from verlj.engine.post_mortem import materialize

    if probe is not None or steps is not None or workers != 1:
        if probe is None or steps is None or to_step is not None or export or export_adapter or snapshot or fork:
            raise fail("--probe and --steps go together (with --workers), without --to-step, --export, --export-adapter, --snapshot or --fork", 2)
        _probe(run, steps, probe, workers, out)
        return
    if to_step is None:
        raise fail("--to-step N is needed (or --steps A:B with --probe)", 2)
    if overrides and fork is None:
        raise fail("config overrides are only meaningful with --fork", 2)
    if to_step < 0:
        raise fail("--to-step must be a step number (>= 1)", 2)
    guarded(lambda: materialize.check_outputs(export, snapshot, fork, export_adapter))
    if fork is not None:  # a config the fork would refuse is refused before the replay, not after it
        from verlj.engine.loop.run import check_fork

        guarded(lambda: check_fork(run, to_step, fork, list(overrides or [])))
    replayed = guarded(lambda: materialize.materialize(run, to_step, quiet=not verbose))
    if export is not None:
        guarded(lambda: materialize.export_hf(replayed, export))
    if export_adapter is not None:
        guarded(lambda: materialize.export_adapter(replayed, export_adapter))
    if snapshot is not None:
        guarded(lambda: materialize.write_snapshot(replayed, snapshot))
    if replayed.run.rt.is_main:
        if as_json:
            out(materialize.replay_report(replayed))
        else:
            src = f"snapshot step_{replayed.from_snapshot:05d}" if replayed.from_snapshot else "the initial state"
            n = replayed.step - replayed.from_snapshot
            out(f"step {replayed.step}: fingerprint {replayed.fingerprint} (from {src}, replayed {n} step{'' if n == 1 else 's'})")
            if (line := materialize.exactness_line(replayed)) is not None:
                out(line)
            if export is not None:
                out(f"exported the actor to {export}")
            if export_adapter is not None:
                out(f"exported the LoRA adapters to {export_adapter}")
            if snapshot is not None:
                out(f"wrote a snapshot to {snapshot}")
    if fork is not None:
        from verlj.engine.loop.run import fork as fork_run

        last = guarded(lambda: fork_run(replayed, run, fork, list(overrides or [])), INTERRUPTED_TRAINING)
        out(f"Done: forked run {fork}, last committed step {last}")


def _probe(run: Path, steps: str, probe: str, workers: int, out) -> None:
    """`--probe F --steps A:B`: F's measurements before each step, one JSON line a step, stored with the run."""
    import json

    from verlj.engine.post_mortem import probe as probes
    from verlj.engine.post_mortem.rerun import parse_steps

    start, stop = guarded(lambda: parse_steps(steps))
    rows, parts, note = guarded(lambda: probes.probe_steps(run, start, stop, probe, workers))
    for row in rows:
        out(json.dumps(row.to_dict()))
    if note:
        typer.echo(note, err=True)
    split = f" in {len(parts)} processes ({', '.join(f'{a}–{b}' for a, b in parts)})" if len(parts) > 1 else ""
    typer.echo(f"stored {len(rows)} step(s) of probe {probes.probe_name(probe)}{split}: verlj metrics {run} "
               f"--names probe/{probes.probe_name(probe)}/…", err=True)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)
