"""`verlj diff RUN_A RUN_B`: the first step where two runs differ, and what differs there.

    verlj diff RUN_A RUN_B                 # the first step where two runs differ, and what differs
    verlj diff RUN_A RUN_B --full          # every step's samples compared too (from the archive where pruned)

Reads the journals' summaries (no samples) until a step differs, then that step's records
(reader.StepReader). :class:`Difference` is the answer: ``to_json()`` its ``--json`` form,
:func:`render_diff` its text. Where the first differing stage is one the journal holds only digests
of, post_mortem.rerun.diff_stages re-executes the step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..config import diff_configs
from ..errors import RunError
from ..loop import archive
from ..loop.ledger import Ledger, open_run
from ..loop.reader import StepReader
from ..loop.records import TopologyChange
from ..schema import table
from ..schema.events import Metrics, Rollout, StepEvents
from ..schema.sample import Columns
from .steps import ranges
from .views import TIMING, _json, _view, topology_line


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
    topology: tuple[list[dict], list[dict]] | None = None  # each run's ledger.identity.topology_history (a step differs)
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
    va, vb = ja.lineage.versions_in_force(), jb.lineage.versions_in_force()
    out = {k: [va.get(k), vb.get(k)] for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}
    if rollout is not None:
        step, ra, rb = rollout
        (ea, a), (eb, b) = (ra.engine, ra.version), (rb.engine, rb.version)
        package = {"hf": "transformers", "fleet": "transformers"}.get(ea, ea) if ea == eb else f"{ea}/{eb}"
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
        topology = (ja.identity.topology_history(), jb.identity.topology_history())
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
    stage = first_stage(sa.to_dict(), sb.to_dict())
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
    a, b = ja.identity.first_config(), jb.identity.first_config()
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
    assert d.step is not None  # the first step that differs
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
