"""`verlj export RUN --rollouts`: the rollout table of a run, from the journal and its Parquet archive alike.

    verlj export RUN --rollouts --output rollouts.parquet             # every sample of the run
    verlj export RUN --rollouts --steps 100:200 --format jsonl --output r.jsonl

The table's columns are rl.samples' (its one schema of a sample), plus each sample's fate, derived
here from the journal: ``status`` (consumed | dropped | pending) and ``status_step`` (when).
pyarrow is needed for Parquet only (``pip install 'verlj[archive]'``); JSONL needs nothing more.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import RunError
from ..loop import archive
from ..loop.ledger import open_run
from ..rl.samples import PARQUET_OPTIONS, arrow_schema, num_rows, require_pyarrow, rows, step_columns, text_decoder, to_arrow
from .steps import parse_steps, ranges


def sample_fates(ledger, start: int | None, stop: int | None) -> dict[int, tuple[str, int]]:
    """sample id -> (consumed | dropped, step), from the records' small events (payloads not read).
    Scans from `start` to the end of the run: a sample's fate comes at or after the step that made it."""
    fates: dict[int, tuple[str, int]] = {}
    for record in ledger.journal.iter_steps(start, None, payload=False):
        for kind, status in (("buffer.drop", "dropped"), ("buffer.consume", "consumed")):
            for e in record.all(kind):
                fate = "stale" if e.get("reason") == "stale" else status  # async: too old for any later step
                for sid in np.asarray(e["ids"]).tolist():
                    fates[int(sid)] = (fate, record.step)
    return fates


def group_accounting(ledger) -> dict | None:
    """Async completion order: every group asked of the generator and what became of it, from the
    records' small events (payloads not read); None for a run that never asked (sync, step order).

    ``asked`` groups (``rows``: their dataset rows, in the order asked), ``arrived``, ``regenerated``
    (asked again: in flight when a process stopped), ``in_flight`` (asked, not arrived),
    ``trained``/``dropped``/``waiting`` in samples (dropped by reason), and the faults, each a list
    that must be empty: ``arrived_twice``, ``arrived_unasked``, ``fate_twice`` (a sample consumed or
    dropped twice), ``fate_unarrived`` (one that never arrived). Needs the run from its first step."""
    starts: list[int] = []  # the groups asked, by id (ids are given in increasing order)
    arrived: set[int] = set()
    samples: set[int] = set()
    fated: set[int] = set()
    out = {"rows": [], "regenerated": 0, "trained": 0, "dropped": {}, "arrived_twice": [], "arrived_unasked": [],
           "fate_twice": [], "fate_unarrived": []}
    for record in ledger.journal.iter_steps(None, None, payload=False):
        req = record.first("buffer.request")
        if req is not None:
            starts += np.asarray(req["groups"]).tolist()
            out["rows"] += np.asarray(req["rows"]).tolist()
            out["regenerated"] += len(np.asarray(req.get("regenerated", [])))
        add = record.first("buffer.add")
        for sid in np.asarray(add["ids"]).tolist() if add is not None else []:
            samples.add(sid)
            k = bisect.bisect_right(starts, sid) - 1
            if k < 0:
                out["arrived_unasked"].append(sid)
            elif sid == starts[k]:  # a group's first sample
                if sid in arrived:
                    out["arrived_twice"].append(sid)
                arrived.add(sid)
        for kind in ("buffer.drop", "buffer.consume"):
            for e in record.all(kind):
                for sid in np.asarray(e["ids"]).tolist():
                    if sid in fated:
                        out["fate_twice"].append(sid)
                    if sid not in samples:
                        out["fate_unarrived"].append(sid)
                    fated.add(sid)
                    if kind == "buffer.consume":
                        out["trained"] += 1
                    else:
                        out["dropped"][e["reason"]] = out["dropped"].get(e["reason"], 0) + 1
    if not starts:
        return None
    out.update(asked=len(starts), arrived=len(arrived), in_flight=len(set(starts) - arrived), waiting=len(samples - fated))
    return out


def iter_step_columns(run_dir: Path, ledger, start: int, stop: int, notes: list[str]) -> Iterator[tuple[int, dict]]:
    """(step, columns) for start..stop: from the journal, or from the archive for pruned steps.
    Pruned steps without an archive are skipped and named in `notes`."""
    decoders: dict = {}
    missing: list[int] = []
    arch = archive.Reader(run_dir, ledger)
    for record in ledger.journal.iter_steps(start, stop):
        step = record.step
        if record.pruned:
            cols = arch.step_columns(step)
            if cols is None:
                missing.append(step)
                continue
        else:
            add = record.first("buffer.add")
            if add is None:
                continue
            cfg = ledger.config_at(step)
            key = json.dumps(cfg.get("model", {}).get("actor", {}).get("model_name_or_path"))
            if key not in decoders:
                decoders[key] = text_decoder(cfg)
            cols = step_columns(step, add["samples"], decoders[key])
        yield step, cols
    if missing:
        notes.append(f"steps {ranges(missing)} were pruned without an archive (journal.archive was off): their samples are not in the table")


def export_rollouts(run_dir: Path, output: Path, fmt: str, steps: str | None) -> tuple[int, list[str]]:
    """Write the rollout table of `run_dir` (steps A:B) to `output`. Returns (rows written, notes).
    Written to a temporary name and renamed: a failed export leaves no partial file."""
    import os

    if fmt not in ("parquet", "jsonl"):
        raise RunError(f"--format must be parquet or jsonl, got {fmt!r}")
    if fmt == "parquet":
        require_pyarrow("--format parquet")
    a, b = parse_steps(steps)
    notes: list[str] = []
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    written = 0
    with open_run(run_dir) as ledger:
        first, last = ledger.base_step() + 1, ledger.last_step()
        a, b = max(a or first, first), min(b or last, last)
        if a > b:
            raise RunError(f"--steps selects no step: this run has steps {first}–{last}")
        fates = sample_fates(ledger, a, None)
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                with pq.ParquetWriter(tmp, arrow_schema(True), **PARQUET_OPTIONS) as w:
                    for _step, cols in iter_step_columns(run_dir, ledger, a, b, notes):
                        w.write_table(to_arrow(cols, fates))
                        written += num_rows(cols)
            else:
                with open(tmp, "w") as f:
                    for _step, cols in iter_step_columns(run_dir, ledger, a, b, notes):
                        for row in rows(cols):
                            status, when = fates.get(row["sample_id"], ("pending", None))
                            f.write(json.dumps({**row, "status": status, "status_step": when}, allow_nan=True) + "\n")
                            written += 1
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)
    return written, notes

