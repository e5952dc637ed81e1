"""Post-mortem: what a run did, step by step, read from its journal (also while it trains).

    verlj inspect RUN                      # summary: config, versions, steps, snapshots, lineage, trend
    verlj inspect RUN --step 1247          # everything journaled at step 1247, samples as text
    verlj metrics RUN --names actor/pg_loss --steps 100:200 [--csv | --jsonl | --plot out.png]
    verlj find RUN --where 'actor/grad_norm > 10'
    verlj diff RUN_A RUN_B                 # the first step where two runs differ, and what differs

Metrics, find and diff read the journal's summary sub-database (no samples), so they stream a long
run quickly; a single step is one key lookup.

Each command's answer is a frozen dataclass here (:class:`RunSummary`, :class:`StepDetail`,
:class:`Match`, :class:`Difference`): ``to_json()`` is its ``--json`` form, ``render_*`` its text.
Journal records are read through ``schema.events.StepEvents``; the ledger's own entries through its
typed records (loop.ledger: LineageEntry, TopologyChange, Counterfactual, ...), shown in ``--json``
as they are kept (their ``to_dict()``); the entries it keeps as maps (identity, quarantined and
missing snapshots) and the probe files through the views below.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..config import config_from_stored, diff_configs
from ..errors import RunError
from ..loop import archive
from ..loop.ledger import Counterfactual, Ledger, LineageEntry, ParentRun, TopologyChange, open_run, writer_dir
from ..loop.reader import StepReader
from ..rl.vocab import text_decoder
from ..schema import table
from ..schema.events import ConfigChange, Control, ControlKind, Eval, Metrics, Requests, Rollout, StepEvents
from ..schema.sample import Columns, Sample
from ..state.manifest import check_snapshot
from . import derived
from .steps import parse_steps, ranges

REWARD = "critic/score/mean"  # the summary's trend
PG_LOSS = "actor/pg_loss"
STALENESS_MEAN = "rollout/staleness/mean"  # async: how far behind the samples a step trains on are
STALENESS_MAX = "rollout/staleness/max"
TIMING = "timing_s/"  # the prefix of the wall-time metrics: diff leaves them aside


def check_range(ledger: Ledger, step: int) -> None:
    first, last = ledger.base_step() + 1, ledger.last_step()
    if not first <= step <= last:
        raise RunError(f"step {step} is out of range: this run has steps {first}–{last}")


def _view(cls, d: dict):
    """`cls` (a frozen dataclass) over a plain map another module keeps (the ledger's identity and
    snapshot entries, a probe file's, a rollout-table row): the keys its fields name; a key `d` lacks is the field's default."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _json(view) -> dict:
    """A view's fields as a map, in their order (the values as they are)."""
    return {f.name: getattr(view, f.name) for f in fields(view)}


def _rollout_json(r: Rollout) -> dict:
    """The rollout event as inspect shows it: engine, its package's version, and the async fields."""
    return {"engine": r.engine, "version": r.version, **r.mode_fields()}


def _order(r: Rollout) -> str:
    return "completion order, " if r.completion_order else ""


# ----------------------------------------------------------------------------- views of the ledger's entries


@dataclass(frozen=True)
class Identity:
    """What inspect shows of a run's identity (Ledger.identity); a fact it lacks is None."""

    config_hash: str | None = None
    config: dict | None = None  # as stored (--json shows it so); read through config_from_stored
    versions: dict | None = None
    world_size: int | None = None  # at the start
    created: str | None = None
    counterfactual: dict | None = None  # a what-if's (Ledger.start), as stored


@dataclass(frozen=True)
class Deviation:
    deviation: float = 0
    metric: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """A snapshot the ledger moved aside (Ledger.quarantined: `path`) or found missing (Ledger.missing)."""

    name: str
    reason: str | None = None
    path: str | None = None


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
        }


def run_summary(run_dir: Path, trend_points: int = 20) -> RunSummary:
    from ..state.topology import Topology

    run_dir = Path(run_dir)
    with open_run(run_dir) as ledger:
        identity = _view(Identity, ledger.identity())
        lineage = ledger.lineage_entries()
        topology = ledger.topology_history()
        quarantined = ledger.quarantined()
        missing = ledger.missing()
        last, base = ledger.last_step(), ledger.base_step()
        indexed = {e.path for e in ledger.snapshot_index().values()}
        ranks_now = Topology(**ledger.topology_at(last)).world_size
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
    snaps = []
    names = {p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_")} | indexed
    for name in sorted(names):
        res = check_snapshot(run_dir / name, hash_files=False)
        snaps.append(SnapshotLine(name, name in indexed, res.valid, res.problems[0] if res.problems else None))
    return RunSummary(
        run=str(run_dir), identity=identity, world_size=ranks_now, rollout=rollout, steps_committed=last - base,
        first_step=base + 1 if last > base else None, last_step=last, snapshots=tuple(snaps), lineage=lineage,
        topology=topology, writer=_writer(run_dir), quarantined=quarantined, missing=missing, trend=tuple(trend),
        probes=derived.probes(run_dir),
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


def topology_line(entry: dict) -> str:
    """One topology boundary of the ledger's history (an entry of Ledger.topology_history), in words."""
    from ..state.topology import Topology

    change = TopologyChange.from_dict(entry)
    said = f"from step {change.from_step}: {Topology(**(change.before or {}))} -> {Topology(**change.topology)}"
    if change.checked_steps:
        w = _view(Deviation, change.max_deviation or {})
        said += (f"; {change.checked_steps} replayed step(s) agreed with the journal within the tolerance "
                 f"(largest deviation {w.deviation:.3g}, {w.metric})")
    return said + "; bits differ from here by design, the new fingerprints are the reference"


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
        f"rollout    {ro.engine}" + ("" if not ro.version else f" (transformers {ro.version})" if ro.engine == "hf" else f" {ro.version}")
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
    for q in (_view(Snapshot, x) for x in s.quarantined):
        lines.append(f"quarantine {q.name} ({q.reason}) moved to {q.path}")
    for m in (_view(Snapshot, x) for x in s.missing):
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

    @classmethod
    def of(cls, row: dict) -> SampleLine:
        """A row of the rollout table (schema.table.rows)."""
        text = {name: row[name] or row[f"{name}_ids"] for name in table.TEXT}
        return cls(**{f.name: row[table.TABLE_NAMES.get(f.name, f.name)] for f in fields(cls) if f.name not in text and f.name != "episode"},
                   **text)

    def with_episode(self, sample: Sample, decoder) -> SampleLine:
        return replace(self, episode=EpisodeLine.of(sample, decoder)) if sample.is_episode else self

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "episode"}
        return {**out, **self.episode.to_json()} if self.episode is not None else out


@dataclass(frozen=True)
class TurnLine:
    action: str | list[int]
    observation: str | list[int]
    reward: float | None  # None: the env gave none this turn


@dataclass(frozen=True)
class EpisodeLine:
    """An episode's turns (action ⇒ observation, reward) and how it ended (a fault's reason)."""

    turns: tuple[TurnLine, ...]
    env_end: int
    env_reason: str

    @classmethod
    def of(cls, s: Sample, decoder) -> EpisodeLine:
        def text(ids):
            return decoder.decode(ids.tolist(), skip_special_tokens=False) if decoder else ids.tolist()

        turns = tuple(TurnLine(text(t.action_ids), text(t.observation_ids), None if t.reward != t.reward else t.reward) for t in s.turns())
        return cls(turns, int(s.env_end), s.env_reason)

    @classmethod
    def of_row(cls, row: dict) -> EpisodeLine:
        """From a row of the rollout table (a pruned step's, from the archive): its turns as the archive wrote them."""
        return _view(cls, {**row, table.TURNS: tuple(_view(TurnLine, t) for t in row[table.TURNS])})

    def to_json(self) -> dict:
        return {"turns": [_json(t) for t in self.turns], "env_end": self.env_end, "env_reason": self.env_reason}


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
            fingerprint=ev.fingerprint, control=(*ev.controls, *ev.configs),
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
            "requests": {"groups": req.groups.tolist(), "rows": req.rows.tolist(), "regenerated": req.regenerated.tolist()} if req else None,
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
        cols = None
        if record.pruned:
            cols = archive.Reader(run_dir, ledger).step_columns(step)
            note = (f"samples pruned from the journal (journal.retain_samples); shown from {archive.ARCHIVE_DIR}/"
                    if cols is not None else "samples pruned from the journal (journal.retain_samples) and not archived")
        elif ev.added is not None:
            assert ev.added.samples is not None  # not pruned
            cols = table.step_columns(step, ev.added.samples, decoder)
    episodes = cols is not None and table.TURNS in cols
    samples = [SampleLine.of(r) for r in table.rows(cols, episodes)] if cols is not None else []
    if ev.added is not None and ev.added.samples is not None:  # episodes (rollout.env): each turn's action, observation, reward
        samples = [line.with_episode(s, decoder) for line, s in zip(samples, Columns(ev.added.samples).samples())]
    elif episodes:  # pruned: as the archive holds them
        assert cols is not None  # episodes: the archive's columns
        samples = [replace(line, episode=EpisodeLine.of_row(r)) for line, r in zip(samples, table.rows(cols, episodes))]
    if max_samples is not None:
        samples = samples[:max_samples]
    return StepDetail.of(ev, samples, note, decoder, run_dir)


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
        again = (f"; asked again {len(req.regenerated)} groups in flight when the last process stopped (from their seeds)"
                 if len(req.regenerated) else "")
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
        lines.append(f"  {s.id:>6} {s.group:>6} v{s.policy_version:<3} | {s.prompt!s} → {s.response!s} | {s.score:.4g}{mark}")
        if s.episode is not None:
            for t, turn in enumerate(s.episode.turns):
                lines.append(f"         turn {t + 1}: {turn.action!s} ⇒ {turn.observation!s}" + (f"  reward {turn.reward:.4g}" if turn.reward is not None else ""))
            if s.episode.env_reason:
                lines.append(f"         ended by a fault: {s.episode.env_reason}")
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


# ----------------------------------------------------------------------------- metrics, find


def metric_rows(run_dir: Path, names: list[str] | None, steps: str | None) -> tuple[list[str], list[dict]]:
    """The metric names shown and one row a step: {"step": step, name: value, ...} (--jsonl's lines)."""
    start, stop = parse_steps(steps)
    rows, seen, at = [], set(), []
    probed = derived.values(run_dir)  # `verlj replay --probe`'s, beside the journal
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics(start, stop):
            values = {**values, **probed.get(step, {})}
            seen |= set(values)
            rows.append({"step": step, **(values if names is None else {k: values.get(k) for k in names})})
            at.append(step)
    if names is not None:
        unknown = [n for n in names if n not in seen]
        if unknown and rows:  # measured after a step's commit, some metrics are only in the logs
            logged = _logged_only(Path(run_dir) / "metrics.jsonl", set(unknown))
            for step, row in zip(at, rows):
                row.update(logged.get(step, {}))
            found = {k for values in logged.values() for k in values}
            unknown = [n for n in unknown if n not in found]
        if unknown and rows:
            raise RunError(f"unknown metric {unknown[0]!r}; this run has: {', '.join(sorted(seen))}")
        cols = names
    else:
        cols = sorted(seen)
    return cols, rows


def _logged_only(path: Path, names: set[str]) -> dict[int, dict[str, float]]:
    """step -> {name: value} of `names` in metrics.jsonl: the metrics measured after a step's commit
    (timing_s/commit, journal/ship_lag_steps: run.train_loop logs them), which its record cannot hold."""
    out: dict[int, dict[str, float]] = {}
    try:
        f = open(path)
    except OSError:
        return out
    with f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            hit = {k: row[k] for k in names if k in row}
            if hit and isinstance(row.get("step"), int):
                out.setdefault(row["step"], {}).update(hit)
    return out


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}
_COND = re.compile(r"^\s*([\w/.\-]+)\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$|^\s*([\w/.\-]+)\s+is\s+(nan|inf|not finite)\s*$")


@dataclass
class Condition:
    name: str
    op: str
    value: float | None

    def __call__(self, values: dict) -> bool:
        v = values.get(self.name)
        if v is None:
            return False
        if self.op == "nan":
            return math.isnan(v)
        if self.op == "inf":
            return math.isinf(v)
        if self.op == "not finite":
            return not math.isfinite(v)
        assert self.value is not None  # NAME OP NUMBER
        return _OPS[self.op](v, self.value)


def parse_where(where: str) -> list[Condition]:
    """'actor/grad_norm > 10 and critic/score/mean < 0.1', or 'actor/pg_loss is nan'."""
    conds = []
    for part in re.split(r"\s+and\s+", where.strip()):
        m = _COND.match(part)
        if not m:
            raise RunError(
                f"cannot parse --where {where!r}: use NAME OP NUMBER (OP one of > >= < <= == !=) or NAME is nan|inf|not finite, joined by 'and'"
            )
        if m.group(1):
            try:
                conds.append(Condition(m.group(1), m.group(2), float(m.group(3))))
            except ValueError:
                raise RunError(f"cannot parse --where {where!r}: {m.group(3)!r} is not a number") from None
        else:
            conds.append(Condition(m.group(4), m.group(5), None))
    return conds


@dataclass(frozen=True)
class Match:
    """A step `verlj find` found, with the values of the metrics its condition names."""

    step: int
    values: dict[str, float | None]

    def to_json(self) -> dict:
        return {"step": self.step, **self.values}


def find_steps(run_dir: Path, where: str, limit: int | None = None) -> list[Match]:
    conds = parse_where(where)
    out = []
    names_seen: set[str] = set()
    probed = derived.values(run_dir)
    with open_run(run_dir) as ledger:
        for step, values in ledger.metrics():
            values = {**values, **probed.get(step, {})}
            names_seen |= set(values)
            if all(c(values) for c in conds):
                out.append(Match(step, {c.name: values.get(c.name) for c in conds}))
                if limit is not None and len(out) >= limit:
                    break
    missing = [c.name for c in conds if names_seen and c.name not in names_seen]
    if missing:
        raise RunError(f"unknown metric {missing[0]!r} in --where")
    return out


# ----------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class SampleDifference:
    """The first consumed sample (in the order the update took them) whose field differs, read from the journal."""

    consumed: int  # its position in the update's order
    sample_a: int
    sample_b: int
    field: str
    index: int
    a: Any
    b: Any
    largest_abs_diff: float | None

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class ElementDifference:
    """The first part and element of a stage whose bits differ, both runs' step re-executed
    (state.stages.first_element_difference)."""

    part: str
    index: int | None = None
    a: Any = None
    b: Any = None
    largest_abs_diff: float | None = None

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class StageSummary:
    """A stage's output in a step, summarized (the `stages` event's summary of it: state.stages)."""

    n: int = 0
    mean: float = 0.0
    absmax: float = 0.0


@dataclass(frozen=True)
class StageDifference:
    """The first stage (state.stages) whose digest differs, both sides' summaries ({n, mean, absmax}),
    and where known (`compared`) its first differing element."""

    stage: str
    a: dict | None
    b: dict | None
    element: SampleDifference | ElementDifference | None = None
    compared: bool = False  # the element was looked for (from the journal, or `reexecuted`)
    reexecuted: bool = False

    @property
    def summary_a(self) -> StageSummary | None:
        return _view(StageSummary, self.a) if self.a else None

    @property
    def summary_b(self) -> StageSummary | None:
        return _view(StageSummary, self.b) if self.b else None

    def to_json(self) -> dict:
        element = {"element": self.element.to_json() if self.element is not None else None} if self.compared else {}
        return {"stage": self.stage, "a": self.a, "b": self.b, **element, **({"reexecuted": True} if self.reexecuted else {})}


@dataclass(frozen=True)
class Detail:
    """What differs at the first differing step: metrics (name -> [a, b]) and the first stage."""

    metrics: dict[str, list] | None = None  # None: no step differs (identical, or only in length)
    stages: StageDifference | None = None

    def to_json(self) -> dict:
        if self.metrics is None:
            return {}
        return {"metrics": self.metrics, **({"stages": self.stages.to_json()} if self.stages is not None else {})}


@dataclass(frozen=True)
class Difference:
    """`verlj diff RUN_A RUN_B`: the first step where two journals differ (None: identical), the
    event types that differ there (or ["length"]), config keys and environment ({name: [a, b]})."""

    identical: bool
    step: int | None
    differs: list[str]
    detail: Detail
    config: dict[str, list]
    environment: dict[str, list]
    steps_a: int
    steps_b: int
    topology: tuple[list[dict], list[dict]] | None = None  # each run's Ledger.topology_history (a step differs)
    samples_not_compared: list[int] | None = None  # --full: pruned steps neither holds the samples of (no step differs)

    def reexecuted(self, element: dict | None) -> Difference:
        """With the first differing element of the first differing stage, from both runs' step re-executed."""
        assert self.detail.stages is not None  # a stage differs
        st = replace(self.detail.stages, element=_view(ElementDifference, element) if element is not None else None,
                     compared=True, reexecuted=True)
        return replace(self, detail=replace(self.detail, stages=st))

    def to_json(self) -> dict:
        topology = {"topology": dict(zip(("a", "b"), self.topology))} if self.topology is not None else {}
        skipped = {"samples_not_compared": self.samples_not_compared} if self.samples_not_compared is not None else {}
        return {"identical": self.identical, "step": self.step, "differs": self.differs, "detail": self.detail.to_json(),
                "config": self.config, "environment": self.environment, "steps_a": self.steps_a, "steps_b": self.steps_b,
                **topology, **skipped}


def _canon(x):
    if isinstance(x, np.ndarray):
        return ("nd", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_canon(v) for v in x]
    if isinstance(x, float) and x != x:
        return "nan"
    return x


def _comparable(ev: StepEvents, without_samples: bool = False) -> dict[str, object]:
    """A step's events as diff compares them: control events, timings and the rollout engine's package
    version aside (a version is the environment, named apart: _environment_differences); the samples
    aside too when retention pruned them on one side (`without_samples`). Of a step's drop events,
    the last."""
    metrics = Metrics({k: v for k, v in ev.metrics.values.items() if not k.startswith(TIMING)}) if ev.metrics else None
    rollout = replace(ev.rollout, version=None) if ev.rollout else None
    added = replace(ev.added, samples=None) if ev.added and without_samples else ev.added
    events = (ev.data, rollout, ev.rng, added, ev.consumed, *ev.drops[-1:], ev.plan, ev.requests, metrics, ev.state, ev.stages, ev.eval)
    return {e.TYPE: _canon(e.to_event()) for e in events if e is not None}


def _environment_differences(ja: Ledger, jb: Ledger, rollout: tuple[int, Rollout, Rollout] | None) -> dict[str, list]:
    """Package -> [version in a, version in b]: the library versions (and verlj source digest) each run
    last started on, and the rollout engine's package where a step generated under different ones
    (`rollout`: that step and both runs' rollout there).
    An environment difference alone changes no number: diff names it apart from a training difference."""
    va, vb = ja.versions_in_force(), jb.versions_in_force()
    out = {k: [va.get(k), vb.get(k)] for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}
    if rollout is not None:
        step, ra, rb = rollout
        (ea, a), (eb, b) = (ra.engine, ra.version), (rb.engine, rb.version)
        package = {"hf": "transformers"}.get(ea, ea) if ea == eb else f"{ea}/{eb}"
        if out.get(package) != [a, b]:
            out[f"{package} (rollout, step {step})"] = [a, b]
    return out


def first_difference(run_a: Path, run_b: Path, full: bool = False) -> Difference:
    """The first step where two journals differ (timings, wall time and control events aside).

    Compares the summaries (data, seeds, metrics, fingerprint): samples that differ show there
    too, since the update trains on them. ``full`` also compares every step's samples (slower):
    from the rollout archive where retention pruned them from a journal; the steps whose samples
    neither holds are counted in ``samples_not_compared``. Where the first differing stage is one
    the journal holds only digests of, post_mortem.rerun.diff_stages re-executes the step."""
    not_compared: list[int] = []
    with open_run(run_a) as ja, open_run(run_b) as jb:
        la, lb = ja.last_step(), jb.last_step()
        base = max(ja.base_step(), jb.base_step())
        common = min(la, lb)
        config_changes = _config_differences(ja, jb)
        topology = (ja.topology_history(), jb.topology_history())
        readers = (archive.Reader(Path(run_a), ja), archive.Reader(Path(run_b), jb))
        rollout = None  # the first step whose rollout engine's package version differs
        for x, y in zip(ja.journal.iter_summaries(base + 1, common), jb.journal.iter_summaries(base + 1, common)):
            step, sx, sy = x.step, StepEvents.of(x), StepEvents.of(y)
            if rollout is None and sx.rollout is not None and sy.rollout is not None and sx.rollout.version != sy.rollout.version:
                rollout = (step, sx.rollout, sy.rollout)
            same = _comparable(sx) == _comparable(sy)
            if same and not full:
                continue
            ra, rb = StepReader(ja.journal).read(step), StepReader(jb.journal).read(step)
            pruned = ra.pruned or rb.pruned  # samples gone on one side: compare what both still hold
            fa, fb = StepEvents.of(ra), StepEvents.of(rb)
            ea, eb = _comparable(fa, pruned), _comparable(fb, pruned)
            kinds = sorted(k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k))
            if not kinds and pruned and full:  # then the samples, from the archive
                ca, cb = _step_samples(ra, readers[0]), _step_samples(rb, readers[1])
                if ca is None or cb is None:
                    not_compared.append(step)
                elif not _same_samples(ca, cb):
                    kinds = ["buffer.add"]
            if not kinds:
                continue
            metrics_a, metrics_b = sx.values, sy.values
            metrics = {k: [metrics_a.get(k), metrics_b.get(k)] for k in sorted(set(metrics_a) | set(metrics_b))
                       if not k.startswith(TIMING) and _canon(metrics_a.get(k)) != _canon(metrics_b.get(k))}
            return Difference(False, step, kinds, Detail(metrics, _stage_difference(fa, fb)), config_changes,
                              _environment_differences(ja, jb, rollout), la, lb, topology=topology)
        environment = _environment_differences(ja, jb, rollout)
    if la != lb:
        return Difference(False, common + 1, ["length"], Detail(), config_changes, environment, la, lb, samples_not_compared=not_compared)
    return Difference(True, None, [], Detail(), config_changes, environment, la, lb, samples_not_compared=not_compared)


# the stages whose values the journal holds (compared there); the others are digests only
JOURNALED_STAGES = ("data", "samples", "scores", "ref_logprobs")


def _stage_difference(ea: StepEvents, eb: StepEvents) -> StageDifference | None:
    """The first stage (state.stages) whose digest differs between two records of a step, with both
    sides' summaries; for the stages the journal holds as values (samples, scores, reference
    log-probs), the first consumed sample and token that differ, with both values."""
    from ..state.stages import first_difference as first_stage

    sa, sb = ea.stages, eb.stages
    if sa is None or sb is None:
        return None
    stage = first_stage(sa.as_dict(), sb.as_dict())
    if stage is None:
        return None
    out = StageDifference(stage, sa.summary.get(stage), sb.summary.get(stage))
    if stage in JOURNALED_STAGES and not (ea.pruned or eb.pruned):
        out = replace(out, element=_first_sample_difference(ea, eb, stage), compared=True)
    return out


def _first_sample_difference(ea: StepEvents, eb: StepEvents, stage: str) -> SampleDifference | None:
    """The first consumed sample (in the order the update took them) whose `stage` field differs."""

    def consumed(ev: StepEvents):
        by_id = {s.id: s for s in Columns(ev.added.samples).samples()} if ev.added is not None and ev.added.samples is not None else {}
        return [by_id.get(int(i)) for i in (ev.consumed.ids if ev.consumed is not None else ())]

    field_of = {"data": "index", "samples": "response_ids", "scores": "score", "ref_logprobs": "ref_logprobs"}[stage]
    for n, (a, b) in enumerate(zip(consumed(ea), consumed(eb))):
        if a is None or b is None:
            continue
        f = "prompt_ids" if stage == "samples" and not np.array_equal(a.prompt_ids, b.prompt_ids) else field_of
        va, vb = np.atleast_1d(np.asarray(getattr(a, f))), np.atleast_1d(np.asarray(getattr(b, f)))
        if va.shape == vb.shape and np.array_equal(va, vb):
            continue
        k = next((i for i in range(min(len(va), len(vb))) if va[i] != vb[i]), min(len(va), len(vb)))
        both = min(len(va), len(vb))
        largest = float(np.max(np.abs(va[:both].astype(np.float64) - vb[:both].astype(np.float64)))) if both else None
        return SampleDifference(n, int(a.id), int(b.id), f, int(k), va[k].item() if k < len(va) else None,
                                vb[k].item() if k < len(vb) else None, largest)
    return None


def _step_samples(record, reader) -> dict | None:
    """A step's samples as table columns: from the journal, or from the run's rollout archive when
    retention pruned them (None when it does not hold them, or pyarrow is missing)."""
    if not record.pruned:
        add = StepEvents.of(record).added
        if add is None:
            return {}
        assert add.samples is not None  # not pruned
        return table.step_columns(record.step, add.samples, None)
    try:
        return reader.step_columns(record.step)
    except RunError:
        return None


def _same_samples(a: dict, b: dict) -> bool:
    """Every sample field alike, bit for bit (the decoded text aside: it follows from the ids)."""
    for name in table.COLUMNS + table.EPISODE_COLUMNS:
        if name in table.TEXT or name == table.TURNS:
            continue
        va, vb = a.get(name), b.get(name)
        if isinstance(va, tuple) or isinstance(vb, tuple):
            if not (isinstance(va, tuple) and isinstance(vb, tuple) and all(_equal(p, q) for p, q in zip(va, vb))):
                return False
        elif not _equal(va, vb):
            return False
    return True


def _equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f")  # an env's turn without a reward: NaN


def _config_differences(ja: Ledger, jb: Ledger) -> dict[str, list]:
    """Dotted key -> [value in a, value in b] for the configs the two runs started with."""
    a, b = ja.first_config(), jb.first_config()
    return {k: [_dotted(a, k), _dotted(b, k)] for k in diff_configs(a, b)}


def _dotted(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


_NAMES = {"data": "data (indices drawn)", "rng": "seeds", "rollout": "rollout engine", "buffer.add": "samples", "buffer.drop": "dropped samples",
          "buffer.consume": "consumed samples", "buffer.plan": "planned batches", "metrics": "metrics", "state": "fingerprint", "eval": "held-out eval",
          "stages": "stage digests"}


def render_diff(d: Difference, a: Path, b: Path) -> str:
    config = [f"  config {k}: {va!r} vs {vb!r}" for k, (va, vb) in d.config.items()]
    env = d.environment or {}
    if env:
        config.append(("  environment only (every fingerprint and metric agrees): " if d.identical else "  environment: ")
                      + ", ".join(f"{k} {va} vs {vb}" for k, (va, vb) in env.items()))
    skipped = d.samples_not_compared or []
    unseen = (f"; the samples of {len(skipped)} pruned step{'' if len(skipped) == 1 else 's'} ({ranges(skipped)}) were not "
              "compared: neither the journal nor the rollout archive holds them" if skipped else "")
    if d.identical:
        return "\n".join([f"identical: {a} and {b} agree on all {d.steps_a} steps (timings aside){unseen}", *config])
    if d.differs == ["length"]:
        assert d.step is not None  # the first step one run lacks
        return "\n".join([f"the runs agree up to step {d.step - 1}; {a} has {d.steps_a} steps, {b} has {d.steps_b}", *config])
    lines = [f"first difference at step {d.step}: " + ", ".join(_NAMES.get(k, k) for k in d.differs), *config]
    for history, run in zip(d.topology or ((), ()), (a, b)):
        for entry in history:
            if TopologyChange.from_dict(entry).from_step <= d.step:
                lines.append(f"  note: {run} changed topology {topology_line(entry)}")
    st = d.detail.stages
    if st:
        def summary(x):
            return f"mean {x.mean:.6g}, |max| {x.absmax:.6g}" if x else "digest only"
        lines.append(f"  first differing stage: {st.stage} ({summary(st.summary_a)} vs {summary(st.summary_b)})")
        e = st.element
        if isinstance(e, ElementDifference) and st.reexecuted:
            at = f"[{e.index}]" if e.index is not None else ""
            lines.append(f"    {e.part}{at}: {e.a!r} vs {e.b!r} (largest difference {e.largest_abs_diff!r}; "
                         f"both runs' step {d.step} re-executed)")
        elif st.reexecuted:
            lines.append(f"    re-executed, both runs' step {d.step} give the same {st.stage}: the difference is in the journal only")
        elif isinstance(e, SampleDifference):
            lines.append(f"    consumed sample #{e.consumed} (ids {e.sample_a} / {e.sample_b}) {e.field}[{e.index}]: "
                         f"{e.a!r} vs {e.b!r} (largest difference {e.largest_abs_diff!r})")
    for k, (va, vb) in list((d.detail.metrics or {}).items())[:12]:
        lines.append(f"  {k:32s} {va!r:>14} vs {vb!r}")
    return "\n".join(lines)
