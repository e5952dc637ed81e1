"""Post-mortem: what a run did, step by step, read from its journal (also while it trains).

    verlj inspect RUN                      # summary: config, versions, steps, snapshots, lineage, trend
    verlj inspect RUN --step 1247          # everything journaled at step 1247, samples as text

`verlj metrics` and `verlj find` are post_mortem.metrics's, `verlj diff` post_mortem.diff's. A single
step is one key lookup.

Each command's answer is a frozen dataclass here (:class:`RunSummary`, :class:`StepDetail`; diff's
:class:`Difference` is in post_mortem.diff, and importable from here as before):
``to_json()`` is its ``--json`` form, ``render_*`` its text.
Journal records are read through ``schema.events.StepEvents``; the ledger's own entries through its
typed records (loop.ledger: LineageEntry, TopologyChange, Counterfactual, ...), shown in ``--json``
as they are kept (their ``to_dict()``); the entries it keeps as maps (identity, quarantined and
missing snapshots) and the probe files through the views below.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..config import config_from_stored
from ..errors import UsageError
from ..loop import archive
from ..loop.ledger import Ledger, open_run, writer_dir
from ..loop.reader import StepReader
from ..loop.records import Counterfactual, LineageEntry, ParentRun, Unindexed, attempt_at
from ..rl.faults import UNRESOLVED
from ..rl.vocab import text_decoder
from ..schema import table
from ..schema.events import ConfigChange, Control, ControlKind, Eval, Requests, Rollout, StepEvents
from ..schema.sample import AGENT_TEXT, STATES_TEXT, Columns, EnvEnd, Sample, version_runs
from ..state.manifest import check_snapshot
from . import derived
from .diff import (  # noqa: F401 - `verlj diff`'s answer, re-exported from where it lived (its code: post_mortem.diff)
    JOURNALED_STAGES,
    Detail,
    Difference,
    ElementDifference,
    SampleDifference,
    StageDifference,
    StageSummary,
    first_difference,
    render_diff,
)
from .views import TIMING, _json, _view, topology_line  # noqa: F401 - TIMING: importable from here as before

REWARD = "critic/score/mean"  # the summary's trend
PG_LOSS = "actor/pg_loss"
STALENESS_MEAN = "rollout/staleness/mean"  # async: how far behind the samples a step trains on are
STALENESS_MAX = "rollout/staleness/max"


def check_range(ledger: Ledger, step: int) -> None:
    first, last = ledger.base_step() + 1, ledger.last_step()
    if not first <= step <= last:
        raise UsageError(f"step {step} is out of range: this run has steps {first}–{last}")


def _rollout_json(r: Rollout) -> dict:
    """The rollout event as inspect shows it: engine, its package's version, and the async fields."""
    return {"engine": r.engine, "version": r.version, **r.mode_fields()}


def _order(r: Rollout) -> str:
    return ("completion order, " if r.completion_order else "") + ("partial rollouts, " if r.partial else "")


# ----------------------------------------------------------------------------- views of the ledger's entries


@dataclass(frozen=True)
class Identity:
    """What inspect shows of a run's identity (ledger.identity.all()); a fact it lacks is None."""

    config_hash: str | None = None
    config: dict | None = None  # as stored (--json shows it so); read through config_from_stored
    versions: dict | None = None
    world_size: int | None = None  # at the start
    created: str | None = None
    counterfactual: dict | None = None  # a what-if's (Ledger.start), as stored


@dataclass(frozen=True)
class Probe:
    """A stored probe (derived.probes): its name, version, first and last step and how many."""

    probe: str
    version: str | None = None
    count: int = 0
    steps: list = field(default_factory=list)


# ----------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class SnapshotLine:
    name: str
    indexed: bool
    valid: bool
    problem: str | None


@dataclass(frozen=True)
class Writer:
    """The run's latest writer claim (journal.claim): who trains it, or trained it last."""

    epoch: int
    host: str | None = None
    pid: int | None = None
    command: Any = None
    claimed: str | None = None
    released: Any = None


@dataclass(frozen=True)
class TrendPoint:
    step: int
    reward: float | None
    loss: float | None


@dataclass(frozen=True)
class RunSummary:
    """`verlj inspect RUN`. The ledger's entries (topology, quarantined, missing; lineage as its typed
    records) and the stored probes are kept as the ledger and the probe files hold them: --json shows them so."""

    run: str
    identity: Identity
    world_size: int
    rollout: Rollout
    steps_committed: int
    first_step: int | None
    last_step: int
    snapshots: tuple[SnapshotLine, ...]
    lineage: list[LineageEntry]
    topology: list[dict]
    writer: Writer | None
    quarantined: list[dict]
    missing: list[dict]
    trend: tuple[TrendPoint, ...]
    probes: list[dict]
    agents: dict | None = None  # rollout.agent: the gateway's calls over the committed steps (agent_counts)

    def to_json(self) -> dict:
        ident = self.identity
        return {
            "run": self.run,
            "config_hash": ident.config_hash,
            "config": ident.config,
            "versions": ident.versions,
            "world_size": self.world_size,
            "world_size_at_start": ident.world_size,
            "rollout": _rollout_json(self.rollout),
            "created": ident.created,
            "steps_committed": self.steps_committed,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "snapshots": [_json(x) for x in self.snapshots],
            "lineage": [e.to_dict() for e in self.lineage],
            "topology": self.topology,
            "writer": _json(self.writer) if self.writer is not None else None,
            "quarantined": self.quarantined,
            "missing": self.missing,
            "trend": [_json(t) for t in self.trend],
            "probes": self.probes,
            "counterfactual": ident.counterfactual,
            "agents": self.agents,
        }


AGENT_COUNTS = {"calls_generated": "agent/calls", "calls_from_journal": "agent/calls_from_journal", "divergences": "agent/divergences",
                "prefix_breaks": "agent/prefix_breaks", "malformed_tool_calls": "agent/malformed_tool_calls", "truncated": "agent/truncated",
                "unresolved": UNRESOLVED}
_AGENT_SUMS = {**AGENT_COUNTS, "faults": "rollout/faults"}  # summed over the steps
AGENT_LINE = (("calls_generated", "calls generated"), ("calls_from_journal", "answered from the journal"), ("divergences", "divergences"),
              ("prefix_breaks", "prefix breaks"), ("malformed_tool_calls", "malformed tool calls"),
              ("truncated", "episodes cut at their length"), ("faults", "faults"), ("unresolved", "of them unresolved"))  # inspect's line


def agent_counts(metrics) -> dict | None:
    """rollout.agent's counts over a run's steps ((step, metrics) pairs): calls generated and answered from the
    journal (0 in sync mode: a crashed step's agents run again live; completion order: the calls a crashed process
    made durable), divergences (a re-run's request that differs from the journaled call), prefix breaks, malformed tool calls, the
    episodes whose last answer was cut at its length (truncated) and those that ended by a fault. None without agents."""
    out = dict.fromkeys([*AGENT_COUNTS, "faults"], 0)
    seen = False
    for _, values in metrics:
        if "agent/calls" not in values:
            continue
        seen = True
        for name, key in _AGENT_SUMS.items():
            out[name] += int(values.get(key, 0))
    return out if seen else None


def run_summary(run_dir: Path, trend_points: int = 20) -> RunSummary:
    run_dir = Path(run_dir)
    with open_run(run_dir) as ledger:
        identity = _view(Identity, ledger.identity.all())
        lineage = ledger.lineage.entries()
        topology = ledger.identity.topology_history()
        quarantined = ledger.snapshots.quarantined()
        missing = ledger.snapshots.missing()
        last, base = ledger.last_step(), ledger.base_step()
        indexed = {e.path for e in ledger.snapshots.index().values()}
        ranks_now = ledger.topology_at(last).world_size
        last_summary = ledger.journal.read_summary(last) if last > base else None
        rollout = StepEvents.of(last_summary).rollout if last_summary else None
        if rollout is None:
            rollout = Rollout(config_from_stored(ledger.config_at(last)).rollout.engine, None)
        trend = []
        if last > base:
            steps = sorted({int(x) for x in np.linspace(base + 1, last, num=min(trend_points, last - base))})
            for s in steps:
                summ = ledger.journal.read_summary(s)
                values = StepEvents.of(summ).values if summ else {}
                trend.append(TrendPoint(s, values.get(REWARD), values.get(PG_LOSS)))
        agents = agent_counts(ledger.metrics()) if last > base else None
    snaps = []
    names = {p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_")} | indexed
    for name in sorted(names):
        res = check_snapshot(run_dir / name, hash_files=False)
        snaps.append(SnapshotLine(name, name in indexed, res.valid, res.problems[0] if res.problems else None))
    return RunSummary(
        run=str(run_dir), identity=identity, world_size=ranks_now, rollout=rollout, steps_committed=last - base,
        first_step=base + 1 if last > base else None, last_step=last, snapshots=tuple(snaps), lineage=lineage,
        topology=topology, writer=_writer(run_dir), quarantined=quarantined, missing=missing, trend=tuple(trend),
        probes=derived.probes(run_dir), agents=agents,
    )


def _writer(run_dir: Path) -> Writer | None:
    """The run's latest writer claim (journal.claim): who trains it, or trained it last."""
    from verlj.journal.claim import current

    found = current(writer_dir(run_dir))
    if found is None:
        return None
    epoch, data = found
    if data is None:
        return None
    return Writer(epoch, **{f.name: data.get(f.name) for f in fields(Writer)[1:]})


def sparkline(values: list[float | None]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("·")
        else:
            out.append(bars[0 if hi == lo else int((v - lo) / (hi - lo) * (len(bars) - 1))])
    return "".join(out)


def render_summary(s: RunSummary) -> str:
    ident, ro = s.identity, s.rollout
    cfg = config_from_stored(ident.config) if ident.config else None
    started_on = "" if s.world_size == ident.world_size else f" (started on {ident.world_size})"
    lines = [
        f"run        {s.run}",
        f"config     hash {ident.config_hash}  algorithm {cfg.algorithm.name if cfg else None}  "
        f"zero {cfg.distributed.zero_stage if cfg else None}  tp {cfg.distributed.tensor_parallel_size if cfg else None}  "
        f"actor {cfg.model.actor.model_name_or_path if cfg else None}",
        "versions   " + "  ".join(f"{k} {v}" for k, v in (ident.versions or {}).items()),
        f"ranks      {s.world_size}{started_on}   created {ident.created}",
        f"rollout    {ro.engine}" + ("" if not ro.version else f" (transformers {ro.version})" if ro.engine in ("hf", "fleet") else f" {ro.version}")
        + (f", async ({_order(ro)}max_staleness {ro.max_staleness})" if ro.is_async else ""),
        f"steps      {s.steps_committed} committed, last step {s.last_step}",
    ]
    if ident.counterfactual:
        cf = Counterfactual.from_dict(ident.counterfactual)
        changed = ", ".join(cf.overrides) if cf.overrides else "nothing (RUN's own config)"
        lines.insert(1, f"what-if    COUNTERFACTUAL: steps {cf.from_step + 1}–{cf.to_step} re-trained on the samples of "
                        f"{cf.run} (not drawn by this run's policy), changed: {changed}")
    if s.snapshots:
        lines.append("snapshots  " + "  ".join(
            f"{x.name}{'' if x.valid else f' ✗ {x.problem}'}{'' if x.indexed else ' (unindexed)'}" for x in s.snapshots))
    else:
        lines.append("snapshots  none")
    if s.writer:
        w = s.writer
        lines.append(f"writer     pid {w.pid} on {w.host} (writer epoch {w.epoch}, claimed {w.claimed}"
                     f"{', released' if w.released else ''})")
    for q in map(Unindexed.from_dict, s.quarantined):
        lines.append(f"quarantine {q.name} ({q.reason}) moved to {q.path}")
    for m in map(Unindexed.from_dict, s.missing):
        lines.append(f"missing    {m.name} was {m.reason}: a resume removed it from the index")
    for entry in s.lineage:
        if entry.kind is ControlKind.START:
            continue
        parent = ParentRun.from_dict(entry.parent) if entry.parent else None
        run, step = (parent.run, parent.step) if parent else (None, None)
        if entry.kind is ControlKind.FORK:
            lines.append(f"lineage    forked from {run} at step {step}")
        elif entry.kind is ControlKind.WHATIF:
            lines.append(f"lineage    a what-if of {run} from its step {step}")
        else:
            changes = f", config changes: {', '.join(entry.config_changes)}" if entry.config_changes else ""
            asked = f" (asked: trainer.resume_from={entry.resume_from})" if entry.resume_from else ""
            lines.append(f"lineage    resumed after step {entry.at_step} from snapshot step {entry.snapshot_step}{asked} "
                         f"at {entry.time}{changes}")
            if entry.versions_changed:
                lines.append(f"versions   changed at that resume: {', '.join(entry.versions_changed)}")
    for change in s.topology:
        lines.append(f"topology   {topology_line(change)}")
    for pr in (_view(Probe, x) for x in s.probes):
        span = f"steps {pr.steps[0]}–{pr.steps[1]} ({pr.count})" if pr.steps else "no steps"
        lines.append(f"probe      {pr.probe} version {pr.version}: {span}, as probe/{pr.probe}/… (verlj replay --probe)")
    if s.agents:
        lines.append("agents     " + ", ".join(f"{s.agents[k]} {what}" for k, what in AGENT_LINE if k != "unresolved" or s.agents[k]))
    if s.trend:
        rewards = [t.reward for t in s.trend]
        losses = [t.loss for t in s.trend]
        fr = [r for r in rewards if r is not None]
        lines.append(f"reward     {sparkline(rewards)}  {fr[0]:.4g} → {fr[-1]:.4g}" if fr else "reward     (none)")
        fl = [x for x in losses if x is not None]
        lines.append(f"pg_loss    {sparkline(losses)}  {fl[0]:.4g} → {fl[-1]:.4g}" if fl else "pg_loss    (none)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class DataLine:
    """The data event as inspect shows it (None, and no indices, when the step has none)."""

    epoch: int | None
    cursor: int | None
    rounds: int | None
    indices: list[int]


@dataclass(frozen=True)
class BufferLine:
    added: int  # how many samples the step generated
    dropped: list[int]  # ids, over every drop event
    consumed: list[int]  # ids, in the order the update took them


@dataclass(frozen=True)
class SampleLine:
    """One sample as inspect --step shows it: its prompt and response as text where the run's decoder
    was found, else as token ids."""

    id: int
    group: int
    index: int
    prompt: str | list[int]
    response: str | list[int]
    score: float
    rule_reward: float
    rm_score: float
    policy_version: int
    episode: EpisodeLine | None = None  # rollout.env: the episode turn by turn
    fault: str = ""  # its reward function's fault (rl.faults; an env's is the episode's env_reason)
    version_runs: tuple = ()  # rollout.partial: (version, tokens) of each run of its tokens' versions

    @classmethod
    def of(cls, row: dict) -> SampleLine:
        """A row of the rollout table (schema.table.rows)."""
        text = {name: row[name] or row[f"{name}_ids"] for name in table.TEXT}
        runs = tuple(map(tuple, version_runs(row.get(table.TOKEN_VERSIONS) or []).reshape(-1, 2).tolist()))
        return cls(**{f.name: row[table.TABLE_NAMES.get(f.name, f.name)] for f in fields(cls)
                      if f.name not in text and f.name not in ("episode", "fault", "version_runs")}, **text, version_runs=runs)

    def with_episode(self, sample: Sample, decoder) -> SampleLine:
        return replace(self, episode=EpisodeLine.of(sample, decoder) if sample.is_episode else None, fault=sample.fault)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "episode" and (f.name not in ("fault", "version_runs") or getattr(self, f.name))}
        return {**out, **self.episode.to_json()} if self.episode is not None else out


@dataclass(frozen=True)
class TurnLine:
    action: str | list[int]
    observation: str | list[int]
    reward: float | None  # None: the env gave none this turn
    state: dict | None = None  # an env with state(): its state after this turn's step (None: none journaled)


@dataclass(frozen=True)
class EpisodeLine:
    """An episode's turns (action ⇒ observation, reward, and the env's state after it where one is journaled) and
    how it ended (a fault's reason)."""

    turns: tuple[TurnLine, ...]
    env_end: int
    env_reason: str
    calls: tuple = ()  # rollout.agent: the episode's model calls (rl.gateway.token_ledger.call_lines)
    reset_state: dict | None = None  # an env with state(): its state after reset (the sample's env_states, first)
    tools: tuple = ()  # rollout.tools: the episode's tool calls (schema.agent_calls.ToolCall), in the order sent

    @classmethod
    def of(cls, s: Sample, decoder) -> EpisodeLine:
        def text(ids):
            return decoder.decode(ids.tolist(), skip_special_tokens=False) if decoder else ids.tolist()

        turns = [TurnLine(text(t.action_ids), text(t.observation_ids), None if t.reward != t.reward else t.reward) for t in s.turns()]
        return cls._made(turns, int(s.env_end), s.env_reason, s.env_states, s.agent_calls)

    @classmethod
    def of_row(cls, row: dict) -> EpisodeLine:
        """From a row of the rollout table (a pruned step's, from the archive): its turns as the archive wrote them, and its
        calls and states where the archive holds them (schema.table.TEXT_COLUMNS)."""
        turns = [_view(TurnLine, t) for t in row[table.TURNS]]
        end = _view(cls, {**row, table.TURNS: ()})  # its end and reason, as the row has them
        return cls._made(turns, end.env_end, end.env_reason, row.get(STATES_TEXT) or "", row.get(AGENT_TEXT) or "")

    @classmethod
    def _made(cls, turns: list[TurnLine], env_end: int, env_reason: str, states_text: str, calls_text: str) -> EpisodeLine:
        """The episode from its turns and its journaled JSON: the env's states (reset's, then one a turn whose step answered)
        and the agent's model and tool calls."""
        from ..rl.gateway.token_ledger import call_lines, tool_lines

        states = json.loads(states_text) if states_text else []
        after = [states[t + 1] if t + 1 < len(states) else None for t in range(len(turns))]
        return cls(tuple(replace(t, state=state) for t, state in zip(turns, after)), int(env_end), env_reason, tuple(call_lines(calls_text)),
                   states[0] if states else None, tuple(tool_lines(calls_text)))

    def to_json(self) -> dict:
        turns = [{k: v for k, v in _json(t).items() if k != "state" or v is not None} for t in self.turns]
        state = {"reset_state": self.reset_state} if self.reset_state is not None else {}
        out = {"turns": turns, "env_end": self.env_end, "env_reason": self.env_reason, **state}
        out = {**out, **({"tools": [t.to_dict() for t in self.tools]} if self.tools else {})}
        return {**out, "calls": [{**asdict(c), "tool_calls": list(c.tool_calls)} for c in self.calls]} if self.calls else out


@dataclass(frozen=True)
class EvalLine:
    """The held-out eval of a step (trainer.eval_interval): each row's response and score."""

    rows: list[int]
    responses: list
    scores: list[float]
    score_mean: float | None

    @classmethod
    def of(cls, ev: Eval, decoder) -> EvalLine:
        responses = [r.tolist() for r in ev.responses()]
        if decoder is not None:
            responses = [decoder.decode(r) for r in responses]
        return cls(ev.rows.tolist(), responses, ev.scores.tolist(), float(ev.scores.mean()) if len(ev.scores) else None)


@dataclass(frozen=True)
class StepDetail:
    """`verlj inspect RUN --step N`: everything journaled at the step."""

    step: int
    time: float
    data: DataLine
    seeds: dict | None
    rollout: Rollout | None
    plans: dict[int, list[int]] | None  # async step order: {step: the sample ids it will train on}
    requests: Requests | None
    rng_digests: dict | None
    buffer: BufferLine
    samples: tuple[SampleLine, ...]
    samples_note: str | None
    metrics: dict[str, float]
    probe_metrics: dict[str, float]  # `verlj replay --probe`'s for this step
    probes: list[dict]  # the stored probes (derived.probes)
    fingerprint: str | None
    control: tuple[Control | ConfigChange, ...]
    eval: EvalLine | None

    @classmethod
    def of(cls, ev: StepEvents, samples: list[SampleLine], note: str | None, decoder, run_dir: Path) -> StepDetail:
        data, rng = ev.data, ev.rng
        return cls(
            step=ev.step, time=ev.time,
            data=DataLine(data.epoch, data.cursor, data.rounds, data.indices.tolist()) if data else DataLine(None, None, None, []),
            seeds=rng.seeds if rng else None, rollout=ev.rollout,
            plans={j: ids.tolist() for j, ids in ev.plan.plans().items()} if ev.plan else None,
            requests=ev.requests, rng_digests=rng.digests if rng else None,
            buffer=BufferLine(len(ev.added.ids) if ev.added else 0, [i for d in ev.drops for i in d.ids.tolist()],
                              ev.consumed.ids.tolist() if ev.consumed else []),
            samples=tuple(samples), samples_note=note, metrics=ev.values,
            probe_metrics=derived.values(run_dir).get(ev.step, {}), probes=derived.probes(run_dir),
            fingerprint=ev.state_fingerprint, control=(*ev.controls, *ev.configs),
            eval=EvalLine.of(ev.eval, decoder) if ev.eval is not None else None,
        )

    def to_json(self) -> dict:
        req = self.requests
        return {
            "step": self.step,
            "time": self.time,
            "data": _json(self.data),
            "seeds": self.seeds,
            "rollout": _rollout_json(self.rollout) if self.rollout else None,
            "plans": self.plans,
            "requests": {"groups": req.groups.tolist(), "rows": req.rows.tolist(), "regenerated": req.regenerated.tolist(),
                         **({"continued": req.continued.tolist()} if len(req.continued) else {})} if req else None,
            "rng_digests": self.rng_digests,
            "buffer": _json(self.buffer),
            "samples": [s.to_json() for s in self.samples],
            "samples_note": self.samples_note,
            "metrics": self.metrics,
            "probes": {"metrics": self.probe_metrics, "stored": self.probes},
            "fingerprint": self.fingerprint,
            "control": [c.to_event() for c in self.control],
            "eval": _json(self.eval) if self.eval else None,
        }


def step_detail(run_dir: Path, step: int, max_samples: int | None = None) -> StepDetail:
    """Everything journaled at `step`, with samples decoded to text (from the rollout archive when
    retention pruned them from the journal)."""
    run_dir = Path(run_dir)
    note = None
    with open_run(run_dir) as ledger:
        check_range(ledger, step)
        record = StepReader(ledger.journal).read(step)
        ev = StepEvents.of(record)
        decoder = text_decoder(ledger.config_at(step))
        attempt, cfg = attempt_at(ledger.lineage.entries(), step), config_from_stored(ledger.config_at(step), unknown="none")
        if attempt > 1 and cfg is not None and cfg.rollout.agent:
            note = f"attempt {attempt}: this step began in {attempt} processes, its agents run again in each (the run's lineage)"
        cols = None
        if record.pruned:
            cols = archive.Reader(run_dir, ledger).step_columns(step)
            note = (f"samples pruned from the journal (journal.retain_samples); shown from {archive.ARCHIVE_DIR}/"
                    if cols is not None else "samples pruned from the journal (journal.retain_samples) and not archived")
            note += f"; attempt {attempt}" if attempt > 1 else ""
        elif ev.added is not None:
            assert ev.added.samples is not None  # not pruned
            cols = table.step_columns(step, ev.added.samples, decoder)
    episodes = cols is not None and table.TURNS in cols
    samples = [SampleLine.of(r) for r in table.rows(cols, episodes, table.TOKEN_VERSIONS in cols)] if cols is not None else []
    if ev.added is not None and ev.added.samples is not None:  # episodes (rollout.env): each turn's action, observation, reward
        samples = [line.with_episode(s, decoder) for line, s in zip(samples, Columns(ev.added.samples).samples())]
    elif episodes:  # pruned: as the archive holds them
        assert cols is not None  # episodes: the archive's columns
        texts = tuple(k for k in table.TEXT_COLUMNS if k in cols)  # what the archive holds of the calls and states
        samples = [replace(line, episode=EpisodeLine.of_row(r)) for line, r in zip(samples, table.rows(cols, episodes, texts=texts))]
    if max_samples is not None:
        samples = samples[:max_samples]
    return StepDetail.of(ev, samples, note, decoder, run_dir)


def one_line(text: object) -> str:
    """A text on one line of the step's table: its line breaks written as \\n (a chat prompt spans many lines)."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def _state_line(state: dict) -> str:
    """An env's journaled state on one line: its JSON, keys sorted, at most 200 characters."""
    text = json.dumps(state, sort_keys=True, ensure_ascii=False)
    return one_line(text if len(text) <= 200 else text[:199] + "…")


def render_step(d: StepDetail) -> str:
    lines = [f"step {d.step}  fingerprint {d.fingerprint}"]
    data = d.data
    idx = data.indices
    lines.append(f"data       epoch {data.epoch}  cursor {data.cursor}  rounds {data.rounds}  "
                 f"indices {idx[:16]}{' …' if len(idx) > 16 else ''} ({len(idx)})")
    lines.append(f"seeds      {d.seeds}")
    ro = d.rollout
    if ro:
        lines.append(f"rollout    {ro.engine} {ro.version}" + (f"  async, {_order(ro)}max_staleness {ro.max_staleness}" if ro.is_async else ""))
    b = d.buffer
    lines.append(f"buffer     added {b.added}  dropped {len(b.dropped)}  consumed {len(b.consumed)}")
    m = d.metrics
    if STALENESS_MEAN in m:
        lines.append(f"trained    {len(b.consumed)} samples, staleness mean {m[STALENESS_MEAN]:.3g} max "
                     f"{m[STALENESS_MAX]:.3g} (policy versions behind the one step {d.step} starts from)")
    versions = sorted({s.policy_version for s in d.samples})
    for step, ids in (d.plans or {}).items():
        lines.append(f"planned    step {step} will train on {len(ids)} samples" + (f" (generated here from policy version {versions[-1]})" if versions else ""))
    req = d.requests
    if req:
        rows = req.rows.tolist()
        again = ""
        # went on: from durable tokens, those a push in this process stopped too (not asked again)
        stopped, went_on = set(req.regenerated.tolist()), set(req.continued.tolist())
        if stopped:
            how = [f"{n} {what}" for n, what in ((len(stopped - went_on), "from their seeds"), (len(stopped & went_on), "from their durable tokens")) if n]
            again = f"; asked again {len(stopped)} groups in flight when the last process stopped: {', '.join(how)}"
        lines.append(f"asked      {len(req.groups)} groups of the generator (rows {rows[:8]}{' …' if len(rows) > 8 else ''}){again}")
    for c in d.control:
        lines.append(f"control    {c.kind.value} {c.details}" if isinstance(c, Control) else f"control    {c.TYPE} {c.changed}")
    ev = d.eval
    if ev:
        shown = ", ".join(f"{r}: {resp!r} {sc:.3g}" for r, resp, sc in list(zip(ev.rows, ev.responses, ev.scores))[:4])
        lines.append(f"eval       {len(ev.rows)} held-out prompts, score {ev.score_mean:.4g} (row: response score; {shown}{', …' if len(ev.rows) > 4 else ''})")
    if d.samples_note:
        lines.append(f"samples    {d.samples_note}")
    lines.append("samples    (id group version | prompt → response | score)")
    consumed, dropped = set(b.consumed), set(b.dropped)
    for s in d.samples:
        mark = " consumed" if s.id in consumed else (" dropped" if s.id in dropped else "")
        lines.append(f"  {s.id:>6} {s.group:>6} v{s.policy_version:<3} | {one_line(s.prompt)} → {one_line(s.response)} | {s.score:.4g}{mark}")
        if len(s.version_runs) > 1:  # rollout.partial: its generation went on across weight updates
            lines.append("         tokens by version: " + ", ".join(f"v{v} {n}" for v, n in s.version_runs))
        if s.episode is not None and s.episode.calls:  # an agent's episode: call by call
            for n, c in enumerate(s.episode.calls):
                tools = f"  tool calls: {', '.join(c.tool_calls)}" if c.tool_calls else ""
                lines.append(f"         call {n + 1}{'' if c.trained else ' (not trained: off the trained chain)'}: {c.sent!r} → "
                             f"{c.text!r} [{c.finish_reason}]{tools}{'  ' + c.flag if c.flag else ''}")
        elif s.episode is not None:
            if s.episode.reset_state is not None:
                lines.append(f"         reset state {_state_line(s.episode.reset_state)}")
            for t, turn in enumerate(s.episode.turns):
                lines.append(f"         turn {t + 1}: {one_line(turn.action)} ⇒ {one_line(turn.observation)}" + (f"  reward {turn.reward:.4g}" if turn.reward is not None else "")
                             + (f"  state {_state_line(turn.state)}" if turn.state is not None else ""))
        if s.episode is not None:  # rollout.tools: each tool call, its key, its state and the attempt that made it
            for n, t in enumerate(s.episode.tools):
                lines.append(f"         tool {n + 1}: {t.name}({t.arguments}) → {one_line(t.result)!r}{' (raised)' if t.error else ''}  "
                             f"[{t.effect}, {t.state}, attempt {t.attempt}, key {t.key}]")
        if s.episode is not None and (s.episode.env_end == EnvEnd.LENGTH or s.episode.env_reason):
            ended = "ended by length" if s.episode.env_end == EnvEnd.LENGTH else "ended unresolved, never trained on" \
                if s.episode.env_end == EnvEnd.UNRESOLVED else "ended by a fault"
            lines.append(f"         {ended}" + (f": {s.episode.env_reason}" if s.episode.env_reason else ""))
        if s.fault:
            lines.append(f"         a fault, never trained on: {s.fault}")
    lines.append("metrics")
    for k in sorted(m):
        lines.append(f"  {k:32s} {m[k]:.6g}")
    if d.probe_metrics:
        probe_versions = {p.probe: p.version for p in (_view(Probe, x) for x in d.probes)}
        lines.append("probes     (computed afterwards by verlj replay --probe; not in the journal)")
        for k in sorted(d.probe_metrics):
            name = k.split("/")[1]
            lines.append(f"  {k:32s} {d.probe_metrics[k]:.6g}  (version {probe_versions.get(name)})")
    return "\n".join(lines)
