"""The rollout table: one row per generated sample, for people and tools.

The archive's Parquet files, ``verlj export --rollouts`` and ``inspect --step`` show a step's samples as
rows: ``step``, the sample's fields (:mod:`.sample`; the id under the table's name ``sample_id``, ids and
log-probs as lists), ``prompt`` and ``response`` decoded to text, and on export the sample's fate
(``status``, ``status_step``). :func:`step_columns` builds a step's rows for all three, so they never
disagree. pyarrow is needed for Parquet only (``pip install 'verlj[archive]'``).

A table of episodes (rollout.env) has the episode's fields too (:data:`EPISODE_COLUMNS`): ``turns``, the
episode turn by turn as text (``[{action, observation, reward}]``, reward null where the env gave none),
``env_end``, ``env_reason``, ``env_seed``, and ``loss_mask``, ``turn_lens``, ``turn_rewards`` as lists. A
single-turn run's table has none of them: its files are byte for byte what they were before episodes.
:func:`turn_rows` gives the table one row per turn instead (``export --rollouts --turns``). A table of a run
with partial rollouts (rollout.partial) has ``token_versions`` too: each response token's policy version
(the sample's runs expanded: a generation continued across weight updates shows where each version took over).
A table of steps whose samples can carry text (:data:`TEXT_COLUMNS`) has those columns too: ``fault`` where a step left
samples out for a fault (why each one's reward function failed it; null or "" for the others), ``agent_calls`` for agent
programs (rollout.agent), ``env_states`` for episodes (null where the env has no state()), so that the archive keeps
every sample whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import RunError, VerljError, install_hint
from .sample import AGENT_TEXT, EPISODE_SCALARS, EPISODE_SEQUENCES, EPISODE_TEXT, FAULT_TEXT, RUNS, SCALARS, SEQUENCES, STATES_TEXT, Columns

# ----------------------------------------------------------------------------- the rollout table

SAMPLE_ID, VERSION = "sample_id", "policy_version"  # table columns named in code
TABLE_NAMES = {"id": SAMPLE_ID}  # a field's column name where it differs (a table has several ids)
TEXT = ("prompt", "response")
COLUMNS = ["step", "sample_id", "group", "index", "prompt", "response", *SEQUENCES, "rule_reward", "rm_score", "score", "policy_version"]
FATE = ["status", "status_step"]
TURNS = "turns"  # an episode's turns as text: [{action, observation, reward}]
EPISODE_COLUMNS = [TURNS, "env_end", EPISODE_TEXT, "env_seed", *EPISODE_SEQUENCES]
TOKEN_VERSIONS = "token_versions"  # rollout.partial: each response token's policy version
PARTIAL_COLUMNS = [TOKEN_VERSIONS]
# Text a sample may carry, a column of a table whose steps can have it (loop.archive.TableShape): why its reward function
# failed it (steps that left a sample out for a fault; rl.faults: never trained), an agent episode's model and tool calls as
# JSON (rollout.agent: schema.agent_calls, idempotency keys included), an env's state() after reset and each step as JSON
TEXT_COLUMNS = [FAULT_TEXT, AGENT_TEXT, STATES_TEXT]
_TABLE_SCALARS = {"step": np.int64, **{TABLE_NAMES.get(k, k): dt for k, dt in {**SCALARS, **EPISODE_SCALARS}.items()}}
_TABLE_SEQUENCES = {**SEQUENCES, **EPISODE_SEQUENCES, TOKEN_VERSIONS: np.int64}
_TABLE_TEXT = (*TEXT, EPISODE_TEXT, *TEXT_COLUMNS)


def require_pyarrow(what: str, error: type[VerljError] = RunError):
    """pyarrow, or `error` saying what needs it and how to install it (UsageError where a command asked for it up front:
    exit 2; RunError where a run's own files need it: exit 1)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise error(f"{what} needs pyarrow: {install_hint('archive')}") from None
    return pa


# How the table is written to Parquet (the archive, `export --rollouts x.parquet`): log-probs and
# scores byte-stream-split (their bytes compress well apart, badly interleaved), dictionaries for the
# rest; zstd at level 9. Measured on the default task: 0.67x the bytes of plain zstd row groups.
_FLOATS = [k for k, dt in {**SCALARS, **_TABLE_SEQUENCES}.items() if dt in (np.float32, np.float64)]


def parquet_options(schema) -> dict:
    """The writer's options for a table of `schema` (arrow_schema's): its float columns byte-stream-split,
    the others (their turns' text aside) dictionary-encoded."""
    names = set(schema.names)
    return {"compression": "zstd", "compression_level": 9, "use_byte_stream_split": [c for c in _FLOATS if c in names],
            "use_dictionary": [c for c in COLUMNS + EPISODE_COLUMNS + PARTIAL_COLUMNS + FATE if c in names and c not in _FLOATS and c != TURNS]}


def arrow_schema(with_fate: bool, episodes: bool = False, partial: bool = False, texts: tuple[str, ...] = ()):
    """The table's Parquet schema: with the fate columns (export) or without (the archive); with the
    episode columns for a run of episodes, token_versions for a run with partial rollouts, and `texts` (of
    TEXT_COLUMNS) where the run's samples can carry them."""
    pa = require_pyarrow("Parquet")
    arrow = {np.int64: pa.int64(), np.float64: pa.float64(), np.int32: pa.int32(), np.float32: pa.float32(), np.int8: pa.int8()}
    turn = pa.struct([("action", pa.string()), ("observation", pa.string()), ("reward", pa.float64())])
    types = {**{k: arrow[dt] for k, dt in _TABLE_SCALARS.items()}, **{k: pa.list_(arrow[dt]) for k, dt in _TABLE_SEQUENCES.items()},
             **{k: pa.string() for k in _TABLE_TEXT}, TURNS: pa.list_(turn), "status": pa.string(), "status_step": pa.int64()}
    extra = (EPISODE_COLUMNS if episodes else []) + (PARTIAL_COLUMNS if partial else []) + [k for k in TEXT_COLUMNS if k in texts]
    return pa.schema([(k, types[k]) for k in COLUMNS + extra + (FATE if with_fate else [])])


def step_columns(step: int, samples: dict, decoder) -> dict:
    """One step's samples (the columnar form of a journal's `buffer.add` event) as table columns:
    scalars as arrays, sequences as (flat values, offsets), text as lists of str (an episode's turns:
    lists of {action, observation, reward})."""
    batch = Columns(samples)
    n = batch.n
    episodes = batch.has("env_end")
    cols: dict = {"step": np.full(n, step, np.int64)}
    for k in {**SCALARS, **(EPISODE_SCALARS if episodes else {})}:
        cols[TABLE_NAMES.get(k, k)] = batch.scalar(k)
    if not batch.has("policy_version"):  # journaled before the field existed: a sync step's
        cols[VERSION] = np.full(n, step - 1, np.int64)
    for k, dt in {**SEQUENCES, **(EPISODE_SEQUENCES if episodes else {})}.items():
        arr, lens = batch.padded(k)
        mask = np.arange(arr.shape[1] if arr.ndim == 2 else 0)[None, :] < lens[:, None]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lens, out=offsets[1:])
        cols[k] = (arr[mask] if arr.ndim == 2 else np.zeros(0, dt), offsets)

    def text(ids, skip: bool) -> str:
        return decoder.decode(ids.tolist(), skip_special_tokens=skip) if decoder else ""

    for k, ids, skip in (("prompt", "prompt_ids", True), ("response", "response_ids", False)):
        values, offsets = cols[ids]
        # the prompt's <bos> is the template's; a response shows every token the model wrote (<unk>, <eos>)
        cols[k] = [text(values[offsets[i] : offsets[i + 1]], skip) for i in range(n)]
    if episodes:
        cols[EPISODE_TEXT] = batch.text(EPISODE_TEXT)
        cols[TURNS] = [[{"action": text(t.action_ids, False), "observation": text(t.observation_ids, False),
                         "reward": None if np.isnan(t.reward) else t.reward} for t in s.turns()] for s in batch.samples()]
    for k in TEXT_COLUMNS:  # a reward function's fault; rollout.agent: each episode's calls (export --turns: a row per call); an env's states
        if batch.has(k):
            cols[k] = batch.text(k)
    if batch.has(RUNS):  # rollout.partial: each token's version, its sample's runs expanded
        versions = [s.token_versions() for s in batch.samples()]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(v) for v in versions], out=offsets[1:])
        cols[TOKEN_VERSIONS] = (np.concatenate(versions) if versions else np.zeros(0, np.int64), offsets)
    return cols


def num_rows(cols: dict) -> int:
    return len(cols[SAMPLE_ID])


def to_arrow(cols: dict, fate: dict | None = None, episodes: bool = False, partial: bool = False, texts: tuple[str, ...] = ()):
    """A pyarrow Table of one step's columns (with the fate columns when `fate` is given; with the episode
    columns when `episodes`, null for a step without episodes; token_versions when `partial`; `texts`, null for a
    step whose samples carry none)."""
    pa = require_pyarrow("Parquet")
    arrays = []
    schema = arrow_schema(fate is not None, episodes, partial, texts)
    for name in schema.names:
        typ = schema.field(name).type
        if name in EPISODE_COLUMNS + PARTIAL_COLUMNS + TEXT_COLUMNS and name not in cols:
            arrays.append(pa.nulls(num_rows(cols), typ))
        elif name in _TABLE_SEQUENCES:
            values, offsets = cols[name]
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ.value_type)))
        elif name in FATE:
            assert fate is not None  # the fate columns are in the schema only when a fate is given
            status = [fate.get(int(i), ("pending", None)) for i in cols["sample_id"]]
            arrays.append(pa.array([s[0] if name == "status" else s[1] for s in status], typ))
        else:
            arrays.append(pa.array(cols[name], typ))
    return pa.Table.from_arrays(arrays, schema=schema)


def rows(cols: dict, episodes: bool = False, partial: bool = False, texts: tuple[str, ...] = ()) -> Iterator[dict]:
    """One step's columns as row dicts (JSON-ready values); with the episode columns when `episodes`
    (None for a step without episodes), token_versions when `partial`, `texts` (None where a step has none)."""
    names = COLUMNS + (EPISODE_COLUMNS if episodes else []) + (PARTIAL_COLUMNS if partial else []) + [k for k in TEXT_COLUMNS if k in texts]
    for i in range(num_rows(cols)):
        row: dict = {}
        for name in names:
            if name not in cols:
                row[name] = None
            elif name in _TABLE_SEQUENCES:
                values, offsets = cols[name]
                row[name] = values[offsets[i] : offsets[i + 1]].tolist()
            elif name in _TABLE_TEXT or name == TURNS:
                row[name] = cols[name][i]
            else:
                row[name] = cols[name][i].item()
        yield row


@dataclass(frozen=True)
class SampleRow:
    """A row of the rollout table as a reader uses it (:func:`sample_rows`); the episode's fields are
    empty (``loss_mask`` []) or None (``env_reason``) for a step without episodes."""

    sample_id: int
    group: int
    prompt: str | None
    response: str | None
    score: float
    response_ids: list
    gen_logprobs: list
    loss_mask: list
    env_reason: str | None

    @classmethod
    def of(cls, row: dict) -> SampleRow:
        return cls(row[SAMPLE_ID], row["group"], row["prompt"], row["response"], row["score"], row["response_ids"],
                   row["gen_logprobs"], row.get("loss_mask") or [], row.get(EPISODE_TEXT))


def sample_rows(cols: dict, episodes: bool = False) -> Iterator[SampleRow]:
    """:func:`rows` typed."""
    return (SampleRow.of(row) for row in rows(cols, episodes))


TURN_COLUMNS = ["step", "sample_id", "group", "index", "policy_version", "turn", "action", "observation", "reward", "action_ids",
                "action_logprobs", "observation_ids", "score", "env_end", EPISODE_TEXT]


def row_head(cols: dict, i: int) -> dict:
    """Row `i`'s identity as the per-turn and per-call tables start it: step, sample id, group, index, version."""
    return {"step": cols["step"][i].item(), SAMPLE_ID: cols[SAMPLE_ID][i].item(), "group": cols["group"][i].item(),
            "index": cols["index"][i].item(), VERSION: cols[VERSION][i].item()}


def row_end(cols: dict, i: int) -> dict:
    """Row `i`'s outcome as the per-turn and per-call tables end it: score, env_end (0 outside an episode), reason."""
    return {"score": cols["score"][i].item(), "env_end": cols["env_end"][i].item() if "env_end" in cols else 0,
            EPISODE_TEXT: cols[EPISODE_TEXT][i] if EPISODE_TEXT in cols else ""}


def turn_rows(cols: dict) -> Iterator[dict]:
    """One step's columns as one row a turn (TURN_COLUMNS; JSON-ready values), `turn` counting from 1. A
    single-turn sample is one turn: its response, no observation, reward None, env_end 0 (EnvEnd.NONE)."""
    resp, logp = cols["response_ids"], cols["gen_logprobs"]
    for i in range(num_rows(cols)):
        ids = resp[0][resp[1][i] : resp[1][i + 1]].tolist()
        lps = logp[0][logp[1][i] : logp[1][i + 1]].tolist()
        if TURNS in cols:
            lens_v, lens_o = cols["turn_lens"]
            lens = lens_v[lens_o[i] : lens_o[i + 1]].tolist()
            turns = cols[TURNS][i]
        else:
            lens = [len(ids), 0]
            turns = [{"action": cols["response"][i], "observation": "", "reward": None}]
        head, end = row_head(cols, i), row_end(cols, i)
        at = 0
        for t, turn in enumerate(turns):
            a, o = lens[2 * t], lens[2 * t + 1]
            yield {**head, "turn": t + 1, **turn, "action_ids": ids[at : at + a], "action_logprobs": lps[at : at + a],
                   "observation_ids": ids[at + a : at + a + o], **end}
            at += a + o


def turn_schema(with_fate: bool):
    """turn_rows' Parquet schema (with the fate columns when `with_fate`)."""
    pa = require_pyarrow("Parquet")
    types = {"step": pa.int64(), SAMPLE_ID: pa.int64(), "group": pa.int64(), "index": pa.int64(), VERSION: pa.int64(), "turn": pa.int32(),
             "action": pa.string(), "observation": pa.string(), "reward": pa.float64(), "action_ids": pa.list_(pa.int32()),
             "action_logprobs": pa.list_(pa.float32()), "observation_ids": pa.list_(pa.int32()), "score": pa.float64(),
             "env_end": pa.int8(), EPISODE_TEXT: pa.string(), "status": pa.string(), "status_step": pa.int64()}
    return pa.schema([(k, types[k]) for k in TURN_COLUMNS + (FATE if with_fate else [])])


def table_columns(table) -> dict:
    """Table rows (a pyarrow Table of the archive's schema) back into step_columns' form (with the
    episode columns when the table holds them for these rows)."""
    cols: dict = {}
    held = [name for name in EPISODE_COLUMNS if name in table.column_names and table.num_rows and table.column(name).null_count == 0]
    versions, texts = ([name for name in names if name in table.column_names and table.num_rows and table.column(name).null_count == 0]
                       for names in (PARTIAL_COLUMNS, TEXT_COLUMNS))
    for name in COLUMNS + (held if len(held) == len(EPISODE_COLUMNS) else []) + versions + texts:
        if name == "policy_version" and name not in table.column_names:  # archived before the field existed
            cols[name] = cols["step"] - 1
            continue
        col = table.column(name).combine_chunks()
        if name in _TABLE_SEQUENCES:
            cols[name] = (col.values.to_numpy(zero_copy_only=False).astype(_TABLE_SEQUENCES[name]),
                          col.offsets.to_numpy().astype(np.int32) - int(col.offsets[0].as_py()))
        elif name in _TABLE_TEXT or name == TURNS:
            cols[name] = col.to_pylist()
        else:
            cols[name] = col.to_numpy(zero_copy_only=False).astype(_TABLE_SCALARS[name])
    return cols
