"""`verlj export RUN --rollouts`: the rollout table of a run, from the journal and its Parquet archive alike.

    verlj export RUN --rollouts --output rollouts.parquet             # every sample of the run
    verlj export RUN --rollouts --steps 100:200 --format jsonl --output r.jsonl
    verlj export RUN --rollouts --turns --output turns.parquet       # episodes: one row per turn

The table's columns are schema.table's (its one schema of a sample; a run of episodes, rollout.env, has
the episode's columns too: ``turns``, ``env_end``, ``env_reason``, ``env_seed``, ...; a run with partial rollouts,
rollout.partial, ``token_versions``: each response token's policy version; a run of episodes ``env_states`` too, its env's
state() after reset and each step as JSON text, and a run of agent programs ``agent_calls``, each episode's model and
tool calls as JSON text, idempotency keys included), plus each sample's
fate, derived here from the journal: ``status`` (consumed | dropped | pending) and ``status_step`` (when).
``--turns`` writes one row per turn instead (schema.table.TURN_COLUMNS, then the fate); for a run of agent
programs (rollout.agent), one row per model call (:data:`CALL_COLUMNS`, then the fate: :func:`call_rows`).
pyarrow is needed for Parquet only (``pip install 'verlj[archive]'``); JSONL needs nothing more.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import config_from_stored
from ..errors import UsageError
from ..loop import archive
from ..loop.archive import TableShape
from ..loop.ledger import open_run
from ..loop.reader import StepReader
from ..loop.records import attempt_at
from ..rl.vocab import text_decoder
from ..schema.events import DropReason, StepEvents
from ..schema.sample import AGENT_TEXT
from ..schema.table import (
    SAMPLE_ID,
    VERSION,
    arrow_schema,
    num_rows,
    parquet_options,
    require_pyarrow,
    row_end,
    row_head,
    rows,
    step_columns,
    to_arrow,
    turn_rows,
    turn_schema,
)
from .outputs import check_output, make_parent, remove_made
from .steps import parse_steps, ranges


class Fate(NamedTuple):
    """What became of a sample: ``status`` (consumed | dropped | stale) and the step it happened at.
    A tuple: schema.table.to_arrow reads it as (status, step)."""

    status: str
    step: int


def sample_fates(ledger, start: int | None, stop: int | None) -> dict[int, Fate]:
    """sample id -> its Fate, from the records' small events (payloads not read).
    Scans from `start` to the end of the run: a sample's fate comes at or after the step that made it."""
    fates: dict[int, Fate] = {}
    for record in StepReader(ledger.journal).records(start, None, payload=False):
        ev = StepEvents.of(record)
        for status, ids in _fated(ev):
            for sid in ids.tolist():
                fates[int(sid)] = Fate(status, record.step)
    return fates


def _fated(ev: StepEvents) -> list[tuple[str, np.ndarray]]:
    """A step's (fate, ids): its drops in journal order (stale: async, too old for any later step), then what it trained on."""
    out = [("stale" if d.reason is DropReason.STALE else "dropped", d.ids) for d in ev.drops]
    return out + ([("consumed", ev.consumed.ids)] if ev.consumed is not None else [])


@dataclass(frozen=True)
class Accounting:
    """Async completion order: every group asked of the generator and what became of it (group_accounting).

    ``asked`` groups (``rows``: their dataset rows, in the order asked), ``arrived``, ``regenerated``
    (asked again: in flight when a process stopped), ``in_flight`` (asked, not arrived),
    ``trained``/``dropped``/``waiting`` in samples (dropped: {reason: count}), and the faults, each a
    list that must be empty: ``arrived_twice``, ``arrived_unasked``, ``fate_twice`` (a sample consumed
    or dropped twice), ``fate_unarrived`` (one that never arrived)."""

    rows: list[int]
    regenerated: int
    trained: int
    dropped: dict[str, int]
    arrived_twice: list[int]
    arrived_unasked: list[int]
    fate_twice: list[int]
    fate_unarrived: list[int]
    asked: int
    arrived: int
    in_flight: int
    waiting: int
    in_flight_groups: list[int] = field(default_factory=list)  # their ids
    all_asked: set[int] = field(default_factory=set)


def group_accounting(ledger) -> Accounting | None:
    """Async completion order: every group asked of the generator and what became of it (Accounting),
    from the records' small events (payloads not read); None for a run that never asked (sync, step
    order). Needs the run from its first step."""
    starts: list[int] = []  # the groups asked, by id (ids are given in increasing order)
    rows: list[int] = []
    arrived: set[int] = set()
    samples: set[int] = set()
    fated: set[int] = set()
    regenerated = trained = 0
    dropped: dict[str, int] = {}
    twice: list[int] = []
    unasked: list[int] = []
    fate_twice: list[int] = []
    unarrived: list[int] = []
    for record in StepReader(ledger.journal).records(None, None, payload=False):
        ev = StepEvents.of(record)
        if ev.requests is not None:
            starts += ev.requests.groups.tolist()
            rows += ev.requests.rows.tolist()
            regenerated += len(ev.requests.regenerated)
        for sid in ev.added.ids.tolist() if ev.added is not None else []:
            samples.add(sid)
            k = bisect.bisect_right(starts, sid) - 1
            if k < 0:
                unasked.append(sid)
            elif sid == starts[k]:  # a group's first sample
                if sid in arrived:
                    twice.append(sid)
                arrived.add(sid)
        fates = [(d.reason.value, d.ids) for d in ev.drops] + ([(None, ev.consumed.ids)] if ev.consumed is not None else [])
        for reason, ids in fates:  # reason None: trained on
            for sid in ids.tolist():
                if sid in fated:
                    fate_twice.append(sid)
                if sid not in samples:
                    unarrived.append(sid)
                fated.add(sid)
                if reason is None:
                    trained += 1
                else:
                    dropped[reason] = dropped.get(reason, 0) + 1
    if not starts:
        return None
    return Accounting(rows, regenerated, trained, dropped, twice, unasked, fate_twice, unarrived, asked=len(starts),
                      arrived=len(arrived), in_flight=len(set(starts) - arrived), waiting=len(samples - fated),
                      in_flight_groups=sorted(set(starts) - arrived), all_asked=set(starts))


def iter_step_columns(run_dir: Path, ledger, start: int, stop: int, notes: list[str]) -> Iterator[tuple[int, dict]]:
    """(step, columns) for start..stop: from the journal, or from the archive for pruned steps.
    Pruned steps without an archive are skipped and named in `notes`."""
    decoders: dict = {}
    missing: list[int] = []
    arch = archive.Reader(run_dir, ledger)
    for record in StepReader(ledger.journal).records(start, stop):
        step = record.step
        if record.pruned:
            cols = arch.step_columns(step)
            if cols is None:
                missing.append(step)
                continue
        else:
            added = StepEvents.of(record).added
            if added is None:
                continue
            assert added.samples is not None  # read with its payload, not pruned
            cfg = ledger.config_at(step)
            key = json.dumps(config_from_stored(cfg).model.actor.model_name_or_path)
            if key not in decoders:
                decoders[key] = text_decoder(cfg)
            cols = step_columns(step, added.samples, decoders[key])
        yield step, cols
    if missing:
        notes.append(f"steps {ranges(missing)} were pruned without an archive (journal.archive was off): their samples are not in the table")


CALL_COLUMNS = ["step", "sample_id", "group", "index", "policy_version", "call", "attempt", "messages", "content", "tool_calls", "finish_reason",
                "flag", "trained", "prompt_ids", "completion_ids", "logprobs", "reward", "score", "env_end", "env_reason"]


def call_rows(cols: dict, attempt: int = 1) -> Iterator[dict]:
    """One step's agent episodes as one row a model call (CALL_COLUMNS; JSON-ready values), `call` counting
    from 1, and the attempt of the episode that made it (1; 2, ... when it was run again after a crash: the step's, from
    the run's lineage, loop.records.attempt_at):
    the request's messages (JSON text), the answer's content and tool calls (``name(arguments)``), its
    finish reason and flag, whether the call is in the trained chain, its token ids and log-probs, and the
    episode's reward (the agent's own; None when rollout.reward_fn scored), score and end. An episode that
    made no call (a fault) is one row, call 0, its reason in env_reason."""
    from ..rl.gateway.wire import read_answer
    from ..schema.agent_calls import AgentCalls

    texts = cols.get(AGENT_TEXT) or [""] * num_rows(cols)
    for i, text in enumerate(texts):
        head, tail = row_head(cols, i), row_end(cols, i)
        rec = AgentCalls.from_json(text) if text else AgentCalls((), (), None, 0)
        if not rec.calls:
            yield {**head, "call": 0, "attempt": None, "messages": None, "content": None, "tool_calls": [], "finish_reason": None, "flag": "",
                   "trained": False, "prompt_ids": [], "completion_ids": [], "logprobs": [], "reward": rec.reward, **tail}
            continue
        trained = set(rec.trained)
        for k, c in enumerate(rec.calls):
            answer = read_answer(c.response)
            messages = json.dumps(json.loads(c.request)["messages"], ensure_ascii=False)
            yield {**head, "call": k + 1, "attempt": attempt, "messages": messages, "content": answer.content,
                   "tool_calls": list(answer.tool_calls),
                   "finish_reason": answer.finish_reason, "flag": c.flag, "trained": k in trained, "prompt_ids": c.prompt_ids.tolist(),
                   "completion_ids": c.completion_ids.tolist(), "logprobs": c.logprobs.tolist(), "reward": rec.reward, **tail}


def call_schema():
    """call_rows' Parquet schema, with the fate columns."""
    pa = require_pyarrow("Parquet")
    ids, text = pa.list_(pa.int32()), pa.string()
    types = {"step": pa.int64(), SAMPLE_ID: pa.int64(), "group": pa.int64(), "index": pa.int64(), VERSION: pa.int64(), "call": pa.int32(), "attempt": pa.int32(),
             "messages": text, "content": text, "tool_calls": pa.list_(text), "finish_reason": text, "flag": text, "trained": pa.bool_(),
             "prompt_ids": ids, "completion_ids": ids, "logprobs": pa.list_(pa.float32()), "reward": pa.float64(), "score": pa.float64(),
             "env_end": pa.int8(), "env_reason": text, "status": text, "status_step": pa.int64()}
    return pa.schema([(k, types[k]) for k in CALL_COLUMNS + ["status", "status_step"]])


def export_rollouts(run_dir: Path, output: Path, fmt: str, steps: str | None, turns: bool = False) -> tuple[int, str, list[str]]:
    """Write the rollout table of `run_dir` (steps A:B) to `output`, one row per sample (per turn with
    `turns`, per model call for agent episodes). Returns (rows written, what a row is: samples, turns or
    calls, notes). Written to a temporary name and renamed: a failed export
    leaves no partial file."""
    import os

    if fmt not in ("parquet", "jsonl"):
        raise UsageError(f"--format must be parquet or jsonl, got {fmt!r}")
    if fmt == "parquet":
        require_pyarrow("--format parquet", UsageError)
    check_output("--output", output)
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory; name a file")
    a, b = parse_steps(steps)
    notes: list[str] = []
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    written = 0
    with open_run(run_dir) as ledger:
        first, last = ledger.base_step() + 1, ledger.last_step()
        a, b = max(a or first, first), min(b or last, last)
        if a > b:
            raise UsageError(f"--steps selects no step: this run has steps {first}–{last}")
        fates = sample_fates(ledger, a, None)
        shape = TableShape.of(ledger, a, b)
        episodes, partial, texts = shape.episodes, shape.partial, shape.texts
        calls = turns and shape.calls  # a row per model call
        lineage = ledger.lineage.entries()

        def table_rows(step: int, cols: dict) -> Iterator[dict]:
            for row in (call_rows(cols, attempt_at(lineage, step)) if calls else turn_rows(cols)) if turns else rows(cols, episodes, partial, texts):
                status, when = fates.get(row["sample_id"], ("pending", None))
                yield {**row, "status": status, "status_step": when}

        folders = make_parent(output)
        try:
            if fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                schema = (call_schema() if calls else turn_schema(True)) if turns else arrow_schema(True, episodes, partial, texts)
                with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as w:
                    for step, cols in iter_step_columns(run_dir, ledger, a, b, notes):
                        table = pa.Table.from_pylist(list(table_rows(step, cols)), schema) if turns else to_arrow(cols, fates, episodes, partial, texts)
                        w.write_table(table)
                        written += table.num_rows
            else:
                with open(tmp, "w") as f:
                    for step, cols in iter_step_columns(run_dir, ledger, a, b, notes):
                        for row in table_rows(step, cols):
                            f.write(json.dumps(row, allow_nan=True) + "\n")
                            written += 1
            os.replace(tmp, output)
            folders = []
        finally:
            tmp.unlink(missing_ok=True)
            remove_made(folders)
    return written, "calls" if calls else "turns" if turns else "samples", notes
