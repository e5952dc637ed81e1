"""`verlj export RUN --rollouts --output FILE`: every generated sample of a run as one table.
`verlj export RUN --sft|--dpo --output DIR`: the run's samples as SFT rows or preference pairs, with their lineage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import EXIT_USAGE, fail, guarded, quiet_libraries


def export(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The file to write (--rollouts), or the directory (--sft, --dpo), "
                                                                "never inside a run's directory; folders made as needed, replaced "
                                                                "if it exists (a directory only if empty or an export).")],
    rollouts: Annotated[bool, typer.Option("--rollouts", help="Export the rollout table: one row per generated sample.")] = False,
    sft: Annotated[bool, typer.Option("--sft", help="Export SFT rows, one per chosen sample (prompt/completion, or messages for "
                                                    "episodes and agents), as a `datasets`-loadable directory with a manifest.")] = False,
    dpo: Annotated[bool, typer.Option("--dpo", help="Export preference pairs (prompt/chosen/rejected, both scores) from each group: "
                                                    "its best sample against its worst, or every pair with --all-pairs.")] = False,
    steps: Annotated[Optional[str], typer.Option("--steps", help="START:STOP, inclusive; either may be empty.")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", help="--rollouts: parquet or jsonl (default: from the output's suffix, "
                                                                ".parquet or .jsonl). --sft/--dpo: parquet (default), jsonl, or "
                                                                "arrow (for datasets.load_from_disk).")] = None,
    turns: Annotated[bool, typer.Option("--turns", help="One row per turn of each episode (rollout.env), or per model call of each agent episode (rollout.agent), instead of one per sample.")] = False,
    tokens: Annotated[bool, typer.Option("--tokens", help="--sft/--dpo: keep the token ids as generated (input_ids, labels masked "
                                                          "where the loss mask is 0, the generation log-probs).")] = False,
    min_score: Annotated[Optional[float], typer.Option("--min-score", help="--sft: only samples scoring at least this; --dpo: only "
                                                                           "pairs whose chosen does.")] = None,
    best_of_group: Annotated[bool, typer.Option("--best-of-group", help="--sft: only each group's best sample (rejection sampling; "
                                                                        "the first generated on a tie).")] = False,
    dedupe: Annotated[bool, typer.Option("--dedupe", help="--sft/--dpo: drop a row whose text is exactly an earlier row's.")] = False,
    messages: Annotated[bool, typer.Option("--messages", help="--sft/--dpo: conversational rows (messages) for single-turn samples "
                                                              "too (episodes and agents always are).")] = False,
    all_pairs: Annotated[bool, typer.Option("--all-pairs", help="--dpo: every pair of a group's samples of one prompt, not only "
                                                                "the best against the worst.")] = False,
    margin: Annotated[float, typer.Option("--margin", help="--dpo: the least a chosen must score above its rejected (they never "
                                                           "score the same).")] = 0.0,
) -> None:
    """Write a run's samples from the journal: --rollouts, the rollout table (step, sample id, group, prompt and response as text
    and ids, rewards, score, whether consumed or dropped; an episode's turns, how it ended and its env seed), from the journal and
    the rollout archive alike, for pandas, DuckDB or `datasets`; --sft or --dpo, training data for TRL's SFTTrainer and
    DPOTrainer (or verl's SFT trainer), every row with its lineage (run, step, sample, policy version, score, the step's chain
    hash) and a manifest that `verlj verify DIR --against RUN` checks every row against (docs/guides/datasets.md)."""
    quiet_libraries()
    chosen = [name for name, on in (("--rollouts", rollouts), ("--sft", sft), ("--dpo", dpo)) if on]
    if len(chosen) != 1:
        raise fail("say what to export: --rollouts, --sft or --dpo" if not chosen else f"{' and '.join(chosen)}: export one at a time",
                   EXIT_USAGE)
    if rollouts:
        sft_only = [n for n, on in (("--tokens", tokens), ("--min-score", min_score is not None), ("--best-of-group", best_of_group),
                                    ("--dedupe", dedupe), ("--messages", messages), ("--all-pairs", all_pairs), ("--margin", margin != 0))
                    if on]
        if sft_only:
            raise fail(f"{', '.join(sft_only)} choose{'s' if len(sft_only) == 1 else ''} --sft or --dpo rows; the rollout table has every sample",
                       EXIT_USAGE)
        return _rollouts(run, output, steps, fmt, turns)
    if turns:
        raise fail("--turns writes the rollout table a row per turn: pass it with --rollouts (--sft and --dpo rows keep each "
                   "episode whole, its turns as messages)", EXIT_USAGE)
    from verlj.engine.post_mortem.distill_files import export_dataset

    written = guarded(lambda: export_dataset(run, output, "sft" if sft else "dpo", fmt or "parquet", steps, min_score=min_score,
                                             best_of_group=best_of_group, dedupe=dedupe, messages=messages, tokens=tokens,
                                             all_pairs=all_pairs, margin=margin))
    for note in written.notes:
        typer.echo(note if note.startswith("warning: ") else f"note: {note}", err=True)
    typer.echo(f"wrote {written.rows} {'rows' if sft else 'pairs'} to {output} ({len(written.files)} file{'s' if len(written.files) > 1 else ''}, "
               f"manifest.json); check them with: verlj verify {output} --against {run}")


def _rollouts(run: Path, output: Path, steps: Optional[str], fmt: Optional[str], turns: bool) -> None:
    from verlj.engine.post_mortem.rollouts import export_rollouts

    if fmt is None:
        fmt = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}.get(output.suffix.lower())
        if fmt is None:
            raise fail(f"--output {output}: the rollout table is written as Parquet or JSONL; name the file .parquet or "
                       ".jsonl, or say which with --format", EXIT_USAGE)
    written, unit, notes = guarded(lambda: export_rollouts(run, output, fmt, steps, turns))
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {written} {unit} to {output}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
