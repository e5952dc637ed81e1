"""A generated sample: its one schema, its columnar form (journal, snapshots, ranks), and the rollout table.

A sample is a dict with these fields (FIELDS, the only place they are declared):

    id            int64    unique in the run, in order of generation
    index         int64    the dataset row of its prompt
    group         int64    the id of the first sample of its prompt's group (GRPO's n samples share it)
    score         float64  the reward the update uses: rule_reward + model.reward_model.weight * rm_score
    rule_reward   float64
    rm_score      float64
    policy_version int64   the policy that generated it: the step whose update produced the weights
                           (0 = the initial ones); a sync step s samples from version s-1. Journals
                           from before async rollout lack it: read as step - 1 (they were all sync)
    prompt_ids    int32[]  (int64 in memory)
    response_ids  int32[]  (int64 in memory)
    gen_logprobs  float32[] per response token, as the rollout engine sampled it
    ref_logprobs  float32[] the reference model's, per response token (empty without a KL term)

Samples travel columnar — padded arrays plus lengths (:func:`pack`, :func:`unpack`) — in journal
events, snapshots and between ranks: live training and replay both go through them, so the update
sees bit-identical inputs either way.

The rollout table (the archive's Parquet files, ``verlj export --rollouts``, ``inspect --step``) is one
row per sample: ``step``, the fields above (the id under the table's name ``sample_id``, ids and
log-probs as lists), ``prompt`` and ``response`` decoded to text, and on export the sample's fate
(``status``, ``status_step``). :func:`step_columns` builds a step's rows for all three, so they
never disagree. pyarrow is needed for Parquet only (``pip install 'verlj[archive]'``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import RunError

SCALARS = {"id": np.int64, "index": np.int64, "group": np.int64, "score": np.float64, "rule_reward": np.float64, "rm_score": np.float64,
           "policy_version": np.int64}
UNKNOWN_VERSION = -1  # policy_version of a sample journaled before the field existed (its step - 1: all were sync)
SEQUENCES = {"prompt_ids": np.int32, "response_ids": np.int32, "gen_logprobs": np.float32, "ref_logprobs": np.float32}
FIELDS = {**SCALARS, **SEQUENCES}
PAD = -1  # fills token-id rows past their length in the columnar form (log-probs: 0)


# ----------------------------------------------------------------------------- the columnar form


def pack(samples: list[dict]) -> dict:
    """Samples as columns: each scalar field an array, each sequence field a padded 2-D array and
    `<field>_len` its lengths."""
    n = len(samples)
    out: dict = {k: np.array([s[k] for s in samples], dtype=dt) for k, dt in SCALARS.items()}
    for k, dt in SEQUENCES.items():
        lens = np.array([len(s[k]) for s in samples], dtype=np.int32)
        width = int(lens.max()) if n else 0
        arr = np.full((n, width), PAD if dt is np.int32 else 0, dtype=dt)
        for i, s in enumerate(samples):
            arr[i, : lens[i]] = s[k]
        out[k] = arr
        out[k + "_len"] = lens
    return out


def unpack(cols: dict) -> list[dict]:
    n = len(cols["id"])
    out = []
    if "policy_version" not in cols:  # written before the field existed
        cols = {**cols, "policy_version": np.full(n, UNKNOWN_VERSION, np.int64)}
    for i in range(n):
        s = {k: (int(cols[k][i]) if dt is np.int64 else float(cols[k][i])) for k, dt in SCALARS.items()}
        for k, dt in SEQUENCES.items():
            s[k] = cols[k][i, : cols[k + "_len"][i]].astype(np.int64 if dt is np.int32 else dt)
        out.append(s)
    return out


# ----------------------------------------------------------------------------- the rollout table

TABLE_NAMES = {"id": "sample_id"}  # a field's column name where it differs (a table has several ids)
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


def text_decoder(config: dict | None):
    """The run's decoder (built-in vocabulary or tokenizer.json), or None when it cannot be found."""
    from .vocab import TextDecoder, builtin_chars

    config = config or {}
    path = config.get("model", {}).get("actor", {}).get("model_name_or_path")
    chars = builtin_chars(config.get("model", {}).get("tiny", {}).get("vocab", "digits"), config.get("data", {}).get("train_dataset", ""))
    try:
        return TextDecoder(path, chars) if path else None
    except Exception:  # noqa: BLE001 - no tokenizer.json (model dir moved): show token ids instead
        return None


def step_columns(step: int, samples: dict, decoder) -> dict:
    """One step's samples (the columnar form of a journal's `buffer.add` event) as table columns:
    scalars as arrays, sequences as (flat values, offsets), text as lists of str."""
    n = len(samples.get("id", []))
    cols: dict = {"step": np.full(n, step, np.int64)}
    for k, dt in SCALARS.items():
        cols[TABLE_NAMES.get(k, k)] = np.asarray(samples.get(k, np.zeros(n)), dt)
    if "policy_version" not in samples:  # journaled before the field existed: a sync step's
        cols["policy_version"] = np.full(n, step - 1, np.int64)
    for k, dt in SEQUENCES.items():
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
