"""The rollout table: one row per generated sample, for people and tools.

The archive's Parquet files, ``verlj export --rollouts`` and ``inspect --step`` show a step's samples as
rows: ``step``, the sample's fields (:mod:`.sample`; the id under the table's name ``sample_id``, ids and
log-probs as lists), ``prompt`` and ``response`` decoded to text, and on export the sample's fate
(``status``, ``status_step``). :func:`step_columns` builds a step's rows for all three, so they never
disagree. pyarrow is needed for Parquet only (``pip install 'verlj[archive]'``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import RunError
from .sample import SCALARS, SEQUENCES, Columns

# ----------------------------------------------------------------------------- the rollout table

SAMPLE_ID, VERSION = "sample_id", "policy_version"  # table columns named in code
TABLE_NAMES = {"id": SAMPLE_ID}  # a field's column name where it differs (a table has several ids)
TEXT = ("prompt", "response")
COLUMNS = ["step", "sample_id", "group", "index", "prompt", "response", *SEQUENCES, "rule_reward", "rm_score", "score", "policy_version"]
FATE = ["status", "status_step"]
_TABLE_SCALARS = {"step": np.int64, **{TABLE_NAMES.get(k, k): dt for k, dt in SCALARS.items()}}


def require_pyarrow(what: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise RunError(f"{what} needs pyarrow: pip install 'verlj[archive]'") from None
    return pa


# How the table is written to Parquet (the archive, `export --rollouts x.parquet`): log-probs and
# scores byte-stream-split (their bytes compress well apart, badly interleaved), dictionaries for the
# rest; zstd at level 9. Measured on the default task: 0.67x the bytes of plain zstd row groups.
_FLOATS = [k for k, dt in {**SCALARS, **SEQUENCES}.items() if dt in (np.float32, np.float64)]
PARQUET_OPTIONS = {"compression": "zstd", "compression_level": 9, "use_byte_stream_split": _FLOATS,
                   "use_dictionary": [c for c in COLUMNS + FATE if c not in _FLOATS]}


def arrow_schema(with_fate: bool):
    pa = require_pyarrow("Parquet")
    arrow = {np.int64: pa.int64(), np.float64: pa.float64(), np.int32: pa.int32(), np.float32: pa.float32()}
    types = {**{k: arrow[dt] for k, dt in _TABLE_SCALARS.items()}, **{k: pa.list_(arrow[dt]) for k, dt in SEQUENCES.items()},
             "prompt": pa.string(), "response": pa.string(), "status": pa.string(), "status_step": pa.int64()}
    return pa.schema([(k, types[k]) for k in COLUMNS + (FATE if with_fate else [])])


def step_columns(step: int, samples: dict, decoder) -> dict:
    """One step's samples (the columnar form of a journal's `buffer.add` event) as table columns:
    scalars as arrays, sequences as (flat values, offsets), text as lists of str."""
    batch = Columns(samples)
    n = batch.n
    cols: dict = {"step": np.full(n, step, np.int64)}
    for k in SCALARS:
        cols[TABLE_NAMES.get(k, k)] = batch.scalar(k)
    if not batch.has("policy_version"):  # journaled before the field existed: a sync step's
        cols[VERSION] = np.full(n, step - 1, np.int64)
    for k, dt in SEQUENCES.items():
        arr, lens = batch.padded(k)
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
    return len(cols[SAMPLE_ID])


def to_arrow(cols: dict, fate: dict | None = None):
    """A pyarrow Table of one step's columns (with the fate columns when `fate` is given)."""
    pa = require_pyarrow("Parquet")
    arrays = []
    schema = arrow_schema(fate is not None)
    for name in schema.names:
        typ = schema.field(name).type
        if name in SEQUENCES:
            values, offsets = cols[name]
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ.value_type)))
        elif name in FATE:
            assert fate is not None  # the fate columns are in the schema only when a fate is given
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
            if name in SEQUENCES:
                values, offsets = cols[name]
                row[name] = values[offsets[i] : offsets[i + 1]].tolist()
            elif name in TEXT:
                row[name] = cols[name][i]
            else:
                row[name] = cols[name][i].item()
        yield row


def table_columns(table) -> dict:
    """Table rows (a pyarrow Table of the archive's schema) back into step_columns' form."""
    cols: dict = {}
    for name in COLUMNS:
        if name == "policy_version" and name not in table.column_names:  # archived before the field existed
            cols[name] = cols["step"] - 1
            continue
        col = table.column(name).combine_chunks()
        if name in SEQUENCES:
            cols[name] = (col.values.to_numpy(zero_copy_only=False).astype(SEQUENCES[name]),
                          col.offsets.to_numpy().astype(np.int32) - int(col.offsets[0].as_py()))
        elif name in TEXT:
            cols[name] = col.to_pylist()
        else:
            cols[name] = col.to_numpy(zero_copy_only=False).astype(_TABLE_SCALARS[name])
    return cols
