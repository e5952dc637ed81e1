"""The rollout table: one row per generated sample, from the journal and its Parquet archive alike.

    verlj export RUN --rollouts --output rollouts.parquet             # every sample of the run
    verlj export RUN --rollouts --steps 100:200 --format jsonl --output r.jsonl

Columns (ARCHIVE_SCHEMA, what the archive stores, plus the sample's fate, derived at export time):

    step, sample_id, group, index          int64    the step that generated it; its dataset row
    prompt, response                       string   decoded with the run's tokenizer ("" without one)
    prompt_ids, response_ids               int32[]
    gen_logprobs, ref_logprobs             float32[] per response token (ref: empty without a KL term)
    rule_reward, rm_score, score           float64  score is the reward the update used
    status, status_step                    string, int64: consumed | dropped | pending, and when

A step's rows are built by :func:`step_columns` for the archive (at pruning time), for export and for
``inspect --step``, so the three never disagree. pyarrow is needed for Parquet only (``pip install
'verlj[archive]'``); JSONL needs nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import RunError

SEQ = {"prompt_ids": np.int32, "response_ids": np.int32, "gen_logprobs": np.float32, "ref_logprobs": np.float32}
SCALARS = {"step": np.int64, "sample_id": np.int64, "group": np.int64, "index": np.int64,
           "rule_reward": np.float64, "rm_score": np.float64, "score": np.float64}
TEXT = ("prompt", "response")
COLUMNS = ["step", "sample_id", "group", "index", "prompt", "response", "prompt_ids", "response_ids",
           "gen_logprobs", "ref_logprobs", "rule_reward", "rm_score", "score"]
FATE = ["status", "status_step"]


def require_pyarrow(what: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise RunError(f"{what} needs pyarrow: pip install 'verlj[archive]'") from None
    return pa


def arrow_schema(with_fate: bool):
    pa = require_pyarrow("Parquet")
    types = {**{k: pa.int64() for k in ("step", "sample_id", "group", "index")}, "prompt": pa.string(), "response": pa.string(),
             "prompt_ids": pa.list_(pa.int32()), "response_ids": pa.list_(pa.int32()),
             "gen_logprobs": pa.list_(pa.float32()), "ref_logprobs": pa.list_(pa.float32()),
             "rule_reward": pa.float64(), "rm_score": pa.float64(), "score": pa.float64(),
             "status": pa.string(), "status_step": pa.int64()}
    return pa.schema([(k, types[k]) for k in COLUMNS + (FATE if with_fate else [])])


def text_decoder(config: dict | None):
    """The run's decoder (built-in vocabulary or tokenizer.json), or None when it cannot be found."""
    from ..rl.vocab import TextDecoder

    path = (config or {}).get("model", {}).get("actor", {}).get("model_name_or_path")
    try:
        return TextDecoder(path) if path else None
    except Exception:  # noqa: BLE001 - no tokenizer.json (model dir moved): show token ids instead
        return None


def step_columns(step: int, samples: dict, decoder) -> dict:
    """One step's samples (the journal's columnar `buffer.add` samples) as table columns: scalars as
    arrays, sequences as (flat values, offsets), text as lists of str."""
    n = len(samples.get("id", []))
    cols: dict = {"step": np.full(n, step, np.int64), "sample_id": np.asarray(samples.get("id", []), np.int64)}
    for k in ("group", "index"):
        cols[k] = np.asarray(samples.get(k, np.zeros(n)), np.int64)
    for k in ("rule_reward", "rm_score", "score"):
        cols[k] = np.asarray(samples.get(k, np.zeros(n)), np.float64)
    for k, dt in SEQ.items():
        arr = np.asarray(samples.get(k, np.zeros((n, 0))), dt)
        lens = np.asarray(samples.get(k + "_len", np.zeros(n)), np.int64)
        mask = np.arange(arr.shape[1] if arr.ndim == 2 else 0)[None, :] < lens[:, None]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lens, out=offsets[1:])
        cols[k] = (arr[mask] if arr.ndim == 2 else np.zeros(0, dt), offsets)
    for k, ids, skip in (("prompt", "prompt_ids", True), ("response", "response_ids", False)):
        values, offsets = cols[ids]
        # the prompt's <bos> is the template's; a response shows every token the model wrote (<unk>, <eos>)
        cols[k] = [decoder.decode(values[offsets[i] : offsets[i + 1]].tolist(), skip_special_tokens=skip) if decoder else ""
                   for i in range(n)]
    return cols


def num_rows(cols: dict) -> int:
    return len(cols["sample_id"])


def to_arrow(cols: dict, fate: dict | None = None):
    """A pyarrow Table of one step's columns (with status columns when `fate` is given)."""
    pa = require_pyarrow("Parquet")
    arrays = []
    schema = arrow_schema(fate is not None)
    for name in schema.names:
        typ = schema.field(name).type
        if name in SEQ:
            values, offsets = cols[name]
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ.value_type)))
        elif name in FATE:
            status = [fate.get(int(i), ("pending", None)) for i in cols["sample_id"]]
            arrays.append(pa.array([s[0] if name == "status" else s[1] for s in status], typ))
        else:
            arrays.append(pa.array(cols[name], typ))
    return pa.Table.from_arrays(arrays, schema=schema)


def rows(cols: dict) -> Iterator[dict]:
    """One step's columns as row dicts (JSON-ready values)."""
    for i in range(num_rows(cols)):
        row = {}
        for name in COLUMNS:
            if name in SEQ:
                values, offsets = cols[name]
                row[name] = values[offsets[i] : offsets[i + 1]].tolist()
            elif name in TEXT:
                row[name] = cols[name][i]
            else:
                row[name] = cols[name][i].item()
        yield row


def samples_of(cols: dict) -> list[dict]:
    """inspect --step's view of a step's samples."""
    return [{"id": r["sample_id"], "group": r["group"], "index": r["index"], "prompt": r["prompt"] or r["prompt_ids"],
             "response": r["response"] or r["response_ids"], "score": r["score"], "rule_reward": r["rule_reward"],
             "rm_score": r["rm_score"]} for r in rows(cols)]


def table_columns(table) -> dict:
    """Archive rows (a pyarrow Table in ARCHIVE_SCHEMA) back into step_columns' form."""
    cols: dict = {}
    for name in COLUMNS:
        col = table.column(name).combine_chunks()
        if name in SEQ:
            cols[name] = (col.values.to_numpy(zero_copy_only=False).astype(SEQ[name]),
                          col.offsets.to_numpy().astype(np.int32) - int(col.offsets[0].as_py()))
        elif name in TEXT:
            cols[name] = col.to_pylist()
        else:
            cols[name] = col.to_numpy(zero_copy_only=False).astype(SCALARS[name])
    return cols


# ----------------------------------------------------------------------------- export


def sample_fates(ledger, start: int | None, stop: int | None) -> dict[int, tuple[str, int]]:
    """sample id -> (consumed | dropped, step), from the records' small events (payloads not read).
    Scans from `start` to the end of the run: a sample's fate comes at or after the step that made it."""
    fates: dict[int, tuple[str, int]] = {}
    for record in ledger.journal.iter_steps(start, None, payload=False):
        for e in record["events"]:
            if e["type"] in ("buffer.consume", "buffer.drop"):
                status = "consumed" if e["type"] == "buffer.consume" else "dropped"
                for sid in np.asarray(e["ids"]).tolist():
                    fates[int(sid)] = (status, record["step"])
    return fates


def iter_step_columns(run_dir: Path, ledger, start: int, stop: int, notes: list[str]) -> Iterator[tuple[int, dict]]:
    """(step, columns) for start..stop: from the journal, or from the archive for pruned steps.
    Pruned steps without an archive are skipped and named in `notes`."""
    from ..loop import archive

    decoders: dict = {}
    missing: list[int] = []
    arch = archive.Reader(run_dir, ledger)
    for record in ledger.journal.iter_steps(start, stop):
        step = record["step"]
        if record["pruned"]:
            cols = arch.step_columns(step)
            if cols is None:
                missing.append(step)
                continue
        else:
            add = next((e for e in record["events"] if e["type"] == "buffer.add"), None)
            if add is None:
                continue
            cfg = ledger.config_at(step)
            key = json.dumps(cfg.get("model", {}).get("actor", {}).get("model_name_or_path"))
            if key not in decoders:
                decoders[key] = text_decoder(cfg)
            cols = step_columns(step, add["samples"], decoders[key])
        yield step, cols
    if missing:
        notes.append(f"steps {_ranges(missing)} were pruned without an archive (journal.archive was off): their samples are not in the table")


def _ranges(steps: list[int]) -> str:
    out, a = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], None]):
        if cur != prev + 1:
            out.append(f"{a}" if a == prev else f"{a}–{prev}")
            a = cur
    return ", ".join(out)


def export_rollouts(run_dir: Path, output: Path, fmt: str, steps: str | None) -> tuple[int, list[str]]:
    """Write the rollout table of `run_dir` (steps A:B) to `output`. Returns (rows written, notes).
    Written to a temporary name and renamed: a failed export leaves no partial file."""
    import os

    from .inspection import open_run, parse_steps

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

                with pq.ParquetWriter(tmp, arrow_schema(True), compression="zstd") as w:
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

