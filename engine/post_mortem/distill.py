"""A run's samples as training data: SFT rows and preference pairs, each row with its lineage.

    verlj export RUN --sft -o sft/                                # every sample: prompt, completion
    verlj export RUN --sft --min-score 1 --best-of-group -o rs/   # rejection sampling: each group's best
    verlj export RUN --dpo -o dpo/                                # each group's best against its worst
    verlj export RUN --dpo --all-pairs --margin 0.5 -o pairs/     # every pair half a point apart or more
    verlj export RUN --sft --tokens -o ids/                       # with input_ids, labels, gen_logprobs
    verlj verify sft/ --against RUN                               # every row against the journal

This module makes the rows (:func:`step_rows`: one step's, in order, by the filter of a :class:`Spec`);
``distill_files`` writes them as a ``datasets``-loadable directory with its manifest, ``distill_verify`` checks one
against its run. The same function makes the rows an export writes and the rows its check expects, so a row
either is what the journal holds or is named.

A row's form follows TRL's dataset formats (``SFTTrainer``, ``DPOTrainer``; verl's SFT trainer reads the same):

- single-turn samples: ``prompt`` and ``completion`` (``chosen``/``rejected``), text decoded from the journaled ids
  without special tokens; with ``--messages``, conversational instead.
- episodes (rollout.env) and agent programs (rollout.agent), always conversational: ``messages`` for SFT, and
  ``prompt``/``chosen``/``rejected`` as lists of messages for DPO. Each message has ``role``, ``content``,
  ``tool_calls`` ({id, type, function: {name, arguments (JSON text)}}), ``tool_call_id`` and ``weight``: 1 where its
  tokens are the policy's and the update trained on them, 0 where the loss masked them or they were prompt (an
  env's observations, an agent's tool results and user turns, an agent's answers outside its trained chain):
  OpenAI's fine-tuning convention. An episode is its prompt as a user message, then each action (assistant) and
  the observation the env answered (user); an agent episode its trained chain of calls as the gateway kept it (the last
  call's request, then its answer; ``tools``: the tools it offered, JSON text).
- lineage, every row: ``run`` (the run directory's name), ``step``, ``sample_id`` (DPO: ``chosen_sample_id``,
  ``rejected_sample_id``), ``group``, ``index`` (the dataset row), ``policy_version``, ``score``, and ``chain``, the
  hash of the step's record in the journal's chain (which covers every record before it).
- ``--tokens``: the ids as generated, never text tokenized again. SFT: ``input_ids`` (prompt then response),
  ``labels`` (-100 on the prompt and wherever the loss mask is 0), ``gen_logprobs`` (per input token, 0 where labels
  is -100). DPO: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (TRL's preference collator reads them),
  ``chosen_loss_mask``/``rejected_loss_mask`` and ``chosen_logprobs``/``rejected_logprobs``.

Filters, in this order: a sample a fault ended (an env's, an agent's, its reward function's) is never a row, nor one
the policy wrote no token of; ``--min-score`` (DPO: the chosen's); ``--best-of-group`` (SFT: the highest score of
each group, the first generated on a tie); pairs (DPO: within each group, among the samples of one prompt, the best
against the worst, or ``--all-pairs`` every pair; the chosen's score above the rejected's by ``--margin`` or more,
and never equal); ``--dedupe`` last (exact text: the first row of a text kept). Rows come in step order, then by
sample id. Samples are read from the journal only: a step whose samples retention pruned, or whose record is
damaged, is left out and said.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import config_from_stored
from ..errors import RunError, UsageError
from ..loop.reader import StepReader
from ..rl.gateway.protocol import Message
from ..rl.gateway.token_ledger import trained_chat
from ..rl.vocab import text_decoder
from ..schema.events import StepEvents
from ..schema.record import Record
from ..schema.sample import UNKNOWN_VERSION, Columns, Sample
from .steps import ranges

if TYPE_CHECKING:
    from ..loop.ledger import Ledger

SFT, DPO = "sft", "dpo"
IGNORE = -100  # a label the loss skips (PyTorch's cross-entropy ignore_index, as TRL and transformers use it)
SFT_LINEAGE = ["run", "step", "sample_id", "group", "index", "policy_version", "score", "chain"]
DPO_LINEAGE = ["run", "step", "group", "index", "chain", "chosen_sample_id", "rejected_sample_id", "chosen_policy_version",
               "rejected_policy_version", "score_chosen", "score_rejected"]
SFT_TOKENS = ["input_ids", "labels", "gen_logprobs"]
DPO_TOKENS = ["prompt_ids", "chosen_ids", "rejected_ids", "chosen_loss_mask", "rejected_loss_mask", "chosen_logprobs", "rejected_logprobs"]


@dataclass(frozen=True)
class Spec(Record):
    """What an export holds: its kind (sft | dpo), its steps (inclusive), and its filter. Recorded in the
    manifest (``filter``), from which ``verify --against`` makes the same rows again."""

    kind: str
    first: int
    last: int
    min_score: float | None = None
    best_of_group: bool = False
    dedupe: bool = False
    messages: bool = False  # conversational rows for single-turn samples too
    tokens: bool = False
    all_pairs: bool = False
    margin: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in (SFT, DPO):
            raise RunError(f"an export is sft or dpo, not {self.kind!r}")
        if self.kind == DPO and self.best_of_group:
            raise UsageError("--best-of-group chooses SFT rows; a --dpo export pairs each group's samples (--all-pairs for every pair)")
        if self.kind == SFT and (self.all_pairs or self.margin):
            raise UsageError("--all-pairs and --margin choose preference pairs; pass them with --dpo")
        if self.margin < 0 or not math.isfinite(self.margin):
            raise UsageError(f"--margin {self.margin}: a pair's chosen must score at least this much above its rejected; give 0 or more")
        if self.min_score is not None and not math.isfinite(self.min_score):
            raise UsageError(f"--min-score {self.min_score}: give a finite number")


@dataclass(frozen=True)
class Form(Record):
    """How the run's rows look: conversational (messages) or text, with the agent's tools or not."""

    conversational: bool
    tools: bool

    @classmethod
    def of(cls, configs: list[dict], spec: Spec) -> Form:
        """From the configs in force over the exported steps (Ledger.configs_in)."""
        cfgs = [config_from_stored(c) for c in configs]
        agents = any(c.rollout.agent for c in cfgs)
        return cls(spec.messages or agents or any(c.rollout.env for c in cfgs), agents)

    def columns(self, spec: Spec) -> list[str]:
        """The row's columns, in order."""
        if spec.kind == SFT:
            text = ["messages"] if self.conversational else ["prompt", "completion"]
            return SFT_LINEAGE + text + (["tools"] if self.tools else []) + (SFT_TOKENS if spec.tokens else [])
        return DPO_LINEAGE + ["prompt", "chosen", "rejected"] + (["tools"] if self.tools else []) + (DPO_TOKENS if spec.tokens else [])


# ----------------------------------------------------------------------------- a sample as a chat

def message_row(m: Message, weight: int) -> dict:
    """A message as a row holds it: every key present (one Arrow struct for all), None where it has none."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    return {"role": m.role, "content": m.content, "tool_calls": calls or None, "tool_call_id": m.tool_call_id, "weight": weight}


@dataclass(frozen=True)
class Chat:
    """A sample as a conversation: its messages and their weights (1: the policy's tokens, trained), how many of them
    are its prompt, the tools (JSON text, agents)."""

    messages: tuple[Message, ...]
    weights: tuple[int, ...]
    prompt: int
    tools: str | None = None

    def rows(self, first: int = 0, stop: int | None = None) -> list[dict]:
        """Messages first..stop as a row holds them."""
        return [message_row(m, w) for m, w in zip(self.messages[first:stop], self.weights[first:stop])]

    def key(self) -> bytes:
        """What two samples of one prompt share: the prompt's messages and the tools."""
        return json.dumps([self.rows(0, self.prompt), self.tools], sort_keys=True).encode()


Decode = Callable[[np.ndarray, bool], str]


def chat_of(s: Sample, decode: Decode | None) -> Chat | None:
    """A sample as a Chat: an agent episode from its calls (None: it made no call), any other from its ids,
    turn by turn (an episode's observations masked, weight 0)."""
    if s.agent_calls:
        conv = trained_chat(s.agent_calls)
        if conv is None:
            return None
        weights = tuple(int(k in conv.trained) for k in range(len(conv.messages)))
        return Chat(conv.messages, weights, conv.prompt, None if conv.tools is None else json.dumps(conv.tools, ensure_ascii=False))
    if decode is None:
        raise RunError("the run's tokenizer cannot be found (model.actor.model_name_or_path has no tokenizer.json): its samples' ids "
                       "cannot be written as text")
    out = [(Message("user", decode(s.prompt_ids, True)), 0)]
    for t in s.turns():
        out.append((Message("assistant", decode(t.action_ids, True)), 1))
        if len(t.observation_ids):
            out.append((Message("user", decode(t.observation_ids, False)), 0))
    return Chat(tuple(m for m, _ in out), tuple(w for _, w in out), 1)


# ----------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class Item:
    """A sample that may become a row: the sample, its step's chain hash, and its chat (made from the run's decoder
    when first asked: only for the samples the filter keeps, or pairs)."""

    sample: Sample
    step: int
    chain: str
    decode: Decode | None = None

    @cached_property
    def chat(self) -> Chat:
        chat = chat_of(self.sample, self.decode)
        assert chat is not None, "a sample without a call the policy answered has no token of the policy's: never a row"
        return chat

    @property
    def prompt_key(self) -> bytes:
        return self.sample.prompt_ids.astype(np.int64).tobytes() + b"|" + self.chat.key()


def _ints(a: np.ndarray) -> list[int]:
    return [int(x) for x in np.asarray(a).tolist()]


def _floats(a: np.ndarray) -> list[float]:
    return np.asarray(a, np.float32).tolist()


def _mask(s: Sample) -> list[int]:
    return [int(m) for m in s.policy_mask().tolist()]


def sft_row(item: Item, run: str, form: Form, spec: Spec) -> dict:
    s, chat = item.sample, item.chat
    row = {"run": run, "step": item.step, "sample_id": s.id, "group": s.group, "index": s.index, "policy_version": s.policy_version,
           "score": s.score, "chain": item.chain}
    text = ({"messages": chat.rows()} if form.conversational else
            {"prompt": chat.messages[0].content, "completion": chat.messages[1].content})
    tools = {"tools": chat.tools} if form.tools else {}
    tokens: dict[str, Any] = {}
    if spec.tokens:
        mask = np.asarray(_mask(s), bool)
        response, lead = _ints(s.response_ids), [IGNORE] * len(s.prompt_ids)
        tokens = {"input_ids": _ints(s.prompt_ids) + response,
                  "labels": lead + [t if m else IGNORE for t, m in zip(response, mask.tolist())],
                  "gen_logprobs": [0.0] * len(s.prompt_ids) + _floats(np.where(mask, s.gen_logprobs, 0))}
    return {**row, **text, **tools, **tokens}


def dpo_row(chosen: Item, rejected: Item, run: str, form: Form, spec: Spec) -> dict:
    c, r, n = chosen.sample, rejected.sample, chosen.chat.prompt
    row = {"run": run, "step": chosen.step, "group": c.group, "index": c.index, "chain": chosen.chain, "chosen_sample_id": c.id,
           "rejected_sample_id": r.id, "chosen_policy_version": c.policy_version, "rejected_policy_version": r.policy_version,
           "score_chosen": c.score, "score_rejected": r.score}
    text: dict[str, Any]
    if form.conversational:
        text = {"prompt": chosen.chat.rows(0, n), "chosen": chosen.chat.rows(n), "rejected": rejected.chat.rows(n)}
    else:
        text = {"prompt": chosen.chat.messages[0].content, "chosen": chosen.chat.messages[1].content,
                "rejected": rejected.chat.messages[1].content}
    tools = {"tools": chosen.chat.tools} if form.tools else {}
    tokens: dict[str, Any] = {}
    if spec.tokens:
        tokens = {"prompt_ids": _ints(c.prompt_ids), "chosen_ids": _ints(c.response_ids), "rejected_ids": _ints(r.response_ids),
                  "chosen_loss_mask": _mask(c), "rejected_loss_mask": _mask(r), "chosen_logprobs": _floats(c.gen_logprobs),
                  "rejected_logprobs": _floats(r.gen_logprobs)}
    return {**row, **text, **tools, **tokens}


KEYS = {SFT: ("step", "sample_id"), DPO: ("step", "chosen_sample_id", "rejected_sample_id")}
TEXT_COLUMNS = {SFT: ("prompt", "completion", "messages", "tools"), DPO: ("prompt", "chosen", "rejected", "tools")}


def row_key(kind: str, row: dict) -> tuple[int, ...]:
    """A row's place in an export: rows come in this order, and verify matches them by it."""
    return tuple(row[k] for k in KEYS[kind])


def text_digest(kind: str, row: dict) -> bytes:
    """The row's text, digested (--dedupe: exact text)."""
    text = json.dumps([row.get(k) for k in TEXT_COLUMNS[kind]], sort_keys=True, ensure_ascii=False)
    return blake2b(text.encode(), digest_size=16).digest()


# ----------------------------------------------------------------------------- choosing

@dataclass
class Counts(Record):
    """What the filter did, over the steps read (the manifest's ``counts``)."""

    samples: int = 0  # read from the journal
    faults: int = 0  # a fault ended them: never a row
    empty: int = 0  # the policy wrote no token of them (an agent that made no call)
    below_min_score: int = 0
    not_best_of_group: int = 0
    no_pair: int = 0  # DPO: prompts (a group's samples of one prompt) that gave no pair
    duplicates: int = 0
    rows: int = 0


def _usable(items: list[Item], spec: Spec, counts: Counts) -> list[Item]:
    out = []
    for it in items:
        s = it.sample
        if s.fault_reason:
            counts.faults += 1
        elif s.policy_tokens() == 0:
            counts.empty += 1
        elif spec.kind == SFT and spec.min_score is not None and not s.score >= spec.min_score:
            counts.below_min_score += 1
        else:
            out.append(it)
    return out


def _by(items: list[Item], key) -> dict:
    out: dict = {}
    for it in items:
        out.setdefault(key(it), []).append(it)
    return out


def _rank(it: Item) -> tuple[int, float, int]:
    """Best first: the highest score, the first generated on a tie (a NaN score last)."""
    score = it.sample.score
    return (0, -score, it.sample.id) if score == score else (1, 0.0, it.sample.id)


def choose_sft(items: list[Item], spec: Spec, counts: Counts) -> list[Item]:
    kept = _usable(items, spec, counts)
    if spec.best_of_group:
        best = [min(g, key=_rank) for g in _by(kept, lambda it: it.sample.group).values()]
        counts.not_best_of_group += len(kept) - len(best)
        kept = best
    return sorted(kept, key=lambda it: it.sample.id)


def choose_pairs(items: list[Item], spec: Spec, counts: Counts) -> list[tuple[Item, Item]]:
    """Within each group, among its samples of one prompt: the best against the worst (all_pairs: every pair),
    the chosen scoring at least `margin` above the rejected, never equal, and at least min_score."""
    pairs = []
    for same in _by(_usable(items, spec, counts), lambda it: (it.sample.group, it.prompt_key)).values():
        ranked = sorted(same, key=_rank)
        cands = [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1:]] if spec.all_pairs else [(ranked[0], ranked[-1])]
        found = [(a, b) for a, b in cands if a.sample.score > b.sample.score and a.sample.score - b.sample.score >= spec.margin
                 and (spec.min_score is None or a.sample.score >= spec.min_score)]
        counts.no_pair += not found
        pairs += found
    return sorted(pairs, key=lambda p: (p[0].sample.id, p[1].sample.id))


# ----------------------------------------------------------------------------- a run, step by step

@dataclass(frozen=True)
class StepRows:
    """One step as an export reads it: its rows in order, the ids of every sample it holds (None: it is left
    out), and why it is left out."""

    step: int
    rows: list[dict]
    ids: frozenset[int] | None
    problem: str | None = None


@dataclass
class LeftOut(Record):
    """The steps an export could not read its samples from (the manifest's ``left_out``)."""

    damaged: dict[int, str] = field(default_factory=dict)  # step -> its problem
    pruned: list[int] = field(default_factory=list)  # retention removed its samples

    def notes(self, run_dir) -> list[str]:
        out = []
        for step, problem in self.damaged.items():
            out.append(f"warning: step {step} is damaged in the journal ({problem}): its samples are left out; run `verlj verify {run_dir}`")
        if self.pruned:
            out.append(f"steps {ranges(self.pruned)} were pruned (journal.retain_samples): their samples are left out "
                       "(`verlj export --rollouts` reads them from the rollout archive)")
        return out


class Rows:
    """The rows of an export of one run, made step by step (:meth:`steps`), with what its filter did
    (``counts``) and the steps it left out (``left_out``). Memory stays flat with the steps; --dedupe keeps a
    16-byte digest per row."""

    def __init__(self, ledger: Ledger, run: str, spec: Spec):
        self.ledger, self.run, self.spec = ledger, run, spec
        self.history = ledger.history()
        self.form = Form.of(self.history.configs_in(spec.first, spec.last), spec)
        self.counts = Counts()
        self.left_out = LeftOut()
        self._seen: set[bytes] = set()
        self._decoders: dict[int, tuple[dict, Any]] = {}  # id(config) -> (config, its decoder): the config held, so its id stays its

    def _decoder(self, step: int) -> Decode | None:
        cfg = self.history.config_at(step)  # one of the history's few configs: made into a decoder once each
        if id(cfg) not in self._decoders:
            self._decoders[id(cfg)] = (cfg, text_decoder(cfg))
        dec = self._decoders[id(cfg)][1]
        return None if dec is None else (lambda ids, skip: dec.decode(np.asarray(ids).tolist(), skip_special_tokens=skip))

    def steps(self) -> Iterator[StepRows]:
        for got in StepReader(self.ledger.journal).chained(self.spec.first, self.spec.last):
            if got.record is None:
                self.left_out.damaged[got.step] = got.problem or "unreadable"
                yield StepRows(got.step, [], None, got.problem)
                continue
            if got.record.pruned:
                self.left_out.pruned.append(got.step)
                yield StepRows(got.step, [], None, "its samples were pruned")
                continue
            added = StepEvents.of(got.record).added
            if added is None or added.samples is None:
                yield StepRows(got.step, [], frozenset())
                continue
            samples = Columns(added.samples).samples()
            for s in samples:  # journaled before the field existed: a sync step's, as the rollout table reads it
                s.policy_version = got.step - 1 if s.policy_version == UNKNOWN_VERSION else s.policy_version
            yield StepRows(got.step, self._rows(got.step, got.chain, samples), frozenset(s.id for s in samples))

    def _rows(self, step: int, chain: str, samples: list[Sample]) -> list[dict]:
        decode = self._decoder(step) if not all(s.agent_calls for s in samples) else None
        self.counts.samples += len(samples)
        items = [Item(s, step, chain, decode) for s in samples]
        if self.spec.kind == SFT:
            rows = [sft_row(it, self.run, self.form, self.spec) for it in choose_sft(items, self.spec, self.counts)]
        else:
            rows = [dpo_row(c, r, self.run, self.form, self.spec) for c, r in choose_pairs(items, self.spec, self.counts)]
        if self.spec.dedupe:
            kept = []
            for row in rows:
                d = text_digest(self.spec.kind, row)
                if d in self._seen:
                    self.counts.duplicates += 1
                    continue
                self._seen.add(d)
                kept.append(row)
            rows = kept
        self.counts.rows += len(rows)
        return rows


def arrow_schema(spec: Spec, form: Form):
    """The rows' Arrow schema (pyarrow needed: Parquet and Arrow files)."""
    from ..schema.table import require_pyarrow

    pa = require_pyarrow("Parquet")
    call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    msg = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()),
                     ("weight", pa.int8())])
    text = pa.list_(msg) if form.conversational else pa.string()
    ids, mask, lps = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())
    types = {"run": pa.string(), "step": pa.int64(), "sample_id": pa.int64(), "group": pa.int64(), "index": pa.int64(),
             "policy_version": pa.int64(), "score": pa.float64(), "chain": pa.string(), "messages": pa.list_(msg), "completion": text,
             "prompt": text, "chosen": text, "rejected": text, "tools": pa.string(), "input_ids": ids, "labels": ids, "gen_logprobs": lps,
             "chosen_sample_id": pa.int64(), "rejected_sample_id": pa.int64(), "chosen_policy_version": pa.int64(),
             "rejected_policy_version": pa.int64(), "score_chosen": pa.float64(), "score_rejected": pa.float64(), "prompt_ids": ids,
             "chosen_ids": ids, "rejected_ids": ids, "chosen_loss_mask": mask, "rejected_loss_mask": mask, "chosen_logprobs": lps,
             "rejected_logprobs": lps}
    return pa.schema([(k, types[k]) for k in form.columns(spec)])
