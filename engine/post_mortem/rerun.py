"""`verlj rerun RUN --steps A:B`: re-execute journaled steps from the nearest snapshot, on this
machine, and compare every stage digest (state.stages) with the journal.

One verdict per step: ``reproduced`` (every stage and the fingerprint bit-identical), ``differs``
(at the first stage that differs, with both sides' summary numbers), or ``not checked`` (a step
after one that differed, up to the next snapshot: the state it starts from is no longer the
journal's; from that snapshot on, the check goes on). A step that differs is re-executed a second
time: if the two re-executions agree with each other the difference is ``persistent`` (the recorded
versions that differ from this machine's are named, the verlj source's digest among them; when none
differs, the run's own execution of the step went wrong, or the platform changed), else
``transient`` (this machine does not give the same result twice: suspect its hardware). Each
step's samples are scored again with the reward function the config names as it is now (a reward
model too with --rescore-model): an edited reward module differs at ``scores``, persistent, naming
the module's digest change (loop.provenance.user_modules) and the first sample scored otherwise.
Nothing is written into the run.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import config_from_stored
from ..dist import configure_determinism, setup
from ..errors import ReplayError, RunError, SnapshotError, UsageError
from ..loop.ledger import Ledger, has_run, lost_journal
from ..loop.provenance import produced_on
from ..loop.reader import StepReader
from ..report import Reporter
from ..schema.events import Stages, StepEvents
from ..schema.record import Record
from ..state.hardware import cross_hardware
from .materialize import replay_config

if TYPE_CHECKING:
    import numpy as np

    from ..schema.sample import Sample
    from .diff import Difference

REPRODUCED, DIFFERS, NOT_CHECKED = "reproduced", "differs", "not checked"  # a step's verdict
PERSISTENT, TRANSIENT = "persistent", "transient"  # a difference's kind
SCORES, STATE = "scores", "state"  # the stages rerun names itself: the rescored rewards, the state after the update


class StepsError(UsageError):
    """--steps names no steps this run can re-execute: a usage error (exit 2)."""


@dataclass(frozen=True)
class _Summary(Record):
    """A stage's summary numbers as the stages event holds them (state.stages)."""

    n: int = 0
    mean: float = 0.0
    absmax: float = 0.0

    @classmethod
    def of(cls, summary: dict) -> _Summary | None:
        return cls.from_dict(summary) if summary else None


@dataclass(frozen=True)
class Rescored(Record):
    """The first sample of a step that the reward function scores otherwise now."""

    id: int
    index: int  # its dataset row
    journaled: float
    rerun: float


@dataclass(frozen=True)
class Verdict(Record):
    """One step's outcome. Its JSON form (`to_dict`) is what `verlj rerun --json` prints per step."""

    step: int
    verdict: str  # REPRODUCED | DIFFERS | NOT_CHECKED
    stage: str | None = None  # the first stage that differs
    journaled: dict[str, float] = field(default_factory=dict)  # that stage's summary {n, mean, absmax} in the journal
    rerun: dict[str, float] = field(default_factory=dict)  # and in this re-execution
    kind: str | None = None  # PERSISTENT | TRANSIENT (the first step that differs)
    sample: Rescored | None = None  # differs at scores: the first sample scored otherwise
    second: dict[str, float] = field(default_factory=dict)  # the second re-execution's summary of that stage
    note: str | None = None  # why a step was not checked, when not for the usual reason


@dataclass(frozen=True)
class RerunReport(Record):
    """`verlj rerun`'s report; `to_dict()` is its JSON (`--json`: its map, then whether every step was
    reproduced), `render()` its text."""

    run: str
    steps: list[int]  # [A, B]
    from_snapshot: int  # the step of the snapshot the re-execution started from (0: the initial state)
    restarted_from: list[int]  # and after each difference
    verdicts: list[Verdict]
    versions_changed: dict[str, list[str | None]]  # {name: [recorded, now]}
    source_recorded: bool  # the run recorded verlj's source digest among its versions
    reward_model: str | None = None  # "rescored" | "kept" (its journaled scores); None without a reward model

    @property
    def reproduced(self) -> bool:
        return all(v.verdict == REPRODUCED for v in self.verdicts)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "reproduced": self.reproduced}  # what readers of the JSON look at first; not read back


@dataclass(frozen=True)
class Observed:
    """One re-executed step, beside what the journal holds of it."""

    journaled: Stages | None  # None: journaled before stage digests
    rerun: Stages
    journaled_fingerprint: str | None
    rerun_fingerprint: str
    kept: dict | None  # with `keep`: {stage: [(name, host array)]} (StepOutcome.kept)

    def first_difference(self) -> str | None:
        """The first stage that differs (STATE: only the fingerprint does), or None."""
        from ..state.stages import first_difference

        stage = first_difference(self.journaled.to_dict(), self.rerun.to_dict()) if self.journaled is not None else None
        if stage is None and self.journaled_fingerprint != self.rerun_fingerprint:
            stage = STATE
        return stage

    def same_as(self, other: Observed) -> bool:
        """Two re-executions of a step agree: every stage and the fingerprint."""
        from ..state.stages import first_difference

        return first_difference(self.rerun.to_dict(), other.rerun.to_dict()) is None and self.rerun_fingerprint == other.rerun_fingerprint


@contextmanager
def steps_reader(run_dir: Path, start: int, stop: int, what: str | None = None):
    """The run's ledger, open for reading, once start..stop are steps it holds; else one line
    (`what`: how the command named them, ``--steps A:B`` by default)."""
    if not has_run(run_dir):
        raise RunError(lost_journal(run_dir) or f"{run_dir} is not a verlj run (no journal/)")
    with Ledger.open_reader(run_dir) as ledger:
        last, base = ledger.last_step(), ledger.base_step()
        if not base < start <= stop <= last:
            raise StepsError(f"{what or f'--steps {start}:{stop}'} is out of range: {run_dir} has steps {base + 1}–{last}")
        yield ledger


def parse_steps(spec: str) -> tuple[int, int]:
    a, sep, b = spec.partition(":")
    try:
        start = int(a)
        stop = int(b) if sep else start
    except ValueError:
        raise StepsError(f"--steps {spec!r} must be A:B (or one step number)") from None
    if start < 1 or stop < start:
        raise StepsError(f"--steps {spec!r} must name steps A <= B, from 1")
    return start, stop


def _execute(run_dir: Path, ledger: Ledger, start: int, stop: int, before=None, checked: bool = False,
             keep: bool = False, rescore: str | None = None, rescored: dict | None = None) -> tuple[int, dict[int, Observed]]:
    """Restore the newest valid snapshot before `start`, re-execute the journaled steps up to `stop`;
    returns (snapshot step, {step: Observed}).
    `checked`: replay's own checks stay on (a probe runs on verified states) and nothing is observed;
    `before(step, inputs, samples, trainer)`: called before each step from `start` on; `keep`: each
    step's Observed also holds the stages' values. `rescore` ("rule", or "model": the reward model
    too): the samples of each step from `start` on are scored again with the reward the config names
    now (Trainer.rescore); `rescored[step]` then holds the first sample whose score changed (Rescored)."""
    from ..loop.checkpointer import make_run
    from ..loop.recovery import replay, restore
    from ..rl.trainer import Trainer

    cfg = replay_config(ledger, start)
    rt = setup(cfg)
    if not checked:  # digests compared bit for bit: only on the process group that made them
        changes = [e.from_step for e in ledger.history().topology_changes]  # the steps from which the topology changed
        for step in sorted({start, stop, *(s for s in changes if start <= s <= stop)}):
            topo = ledger.topology_at(step)
            if (topo.world_size, topo.tensor_parallel_size) != (rt.world_size, rt.tp_size):
                raise RunError(f"step {step} ran on {topo.world_size} rank(s) with TP {topo.tensor_parallel_size}, this is "
                               f"{rt.world_size} with TP {rt.tp_size}: its digests are compared on as many ranks "
                               f"(torchrun --nproc_per_node {topo.world_size} -m verlj.cli ...)")
    configure_determinism(cfg)
    reporter = Reporter(cfg.logging, run_dir, enabled=False, total_steps=stop, sinks=False)
    trainer = Trainer(cfg, rt, keep_stages=keep)
    try:
        run = make_run(run_dir, rt, trainer, reporter, ledger if rt.is_main else None)
        restored = restore(run, start - 1)
        seen: dict[int, Observed] = {}

        def observe(step, record, outcome) -> bool:
            ev = StepEvents.of(record)
            seen[step] = Observed(ev.stages, Stages.from_event(outcome.stages), ev.state_fingerprint, outcome.fingerprint, outcome.kept)
            return True

        def pre(step, inputs, samples) -> None:
            if step < start:
                return
            if rescore is not None:
                journaled = _scores(samples)
                run.trainer.rescore(samples, model=rescore == "model")
                moved = [(j, r) for j, r in zip(journaled, _scores(samples)) if r.rerun != j.rerun]
                if moved and rescored is not None:
                    j, r = moved[0]
                    rescored[step] = replace(j, rerun=r.rerun)
            if before is not None:
                before(step, inputs, samples, run.trainer)

        if restored.step < stop:
            replay(run, run.history(), restored, stop, observe=None if checked else observe,
                   before=pre if before or rescore else None)
        return restored.step, seen
    finally:
        trainer.close()


def _scores(samples: list[Sample]) -> list[Rescored]:
    """Each sample's id, dataset row and score (as `journaled` and `rerun` alike), as replay hands
    the samples to `before`."""
    return [Rescored(int(s.id), int(s.index), s.score, s.score) for s in samples]


def rerun(run_dir: Path, start: int, stop: int, rescore_model: bool = False) -> RerunReport:
    """The verdict of every step start..stop (see the module's doc), as a report. After a step that
    differs, the check goes on from the next snapshot at or after it (which holds the run's state
    as it was, difference included): the steps in between are ``not checked``.

    Each step's samples are scored again with the reward function the config names now (a changed
    one differs at ``scores``, naming the first sample scored otherwise); a reward model's scores only
    with `rescore_model` (a forward pass per sample), else the journal's are kept and the report says so."""
    run_dir = Path(run_dir)
    rescore = "model" if rescore_model else "rule"
    rescored: dict = {}
    with steps_reader(run_dir, start, stop) as ledger:
        config = ledger.config_at(stop)
        reward_model = bool(config_from_stored(config).model.reward_model.model_name_or_path)
        pruned = [s for s in range(ledger.base_step() + 1, stop + 1) if StepReader(ledger.journal).read(s).pruned]
        recorded = ledger.lineage.versions_in_force()
        snapshots = sorted(ledger.snapshots.index())
        verdicts: list[Verdict] = []
        origins: list[int] = []
        pos = start
        while pos <= stop:
            try:
                step0, seen = _execute(run_dir, ledger, pos, stop, rescore=rescore, rescored=rescored)
            except (ReplayError, SnapshotError) as e:
                if not origins:
                    raise
                verdicts += [Verdict(s, NOT_CHECKED, note=f"the restart from the snapshot before it failed: {e}") for s in range(pos, stop + 1)]
                break
            late = [s for s in pruned if s > step0]
            if late:
                raise RunError(f"step {late[0]}'s samples were pruned from the journal (journal.retain_samples) and the newest "
                               f"snapshot before step {pos} is step {step0}: steps {step0 + 1}–{stop} cannot be re-executed")
            if origins and step0 != pos - 1:  # the restart snapshot did not load: nothing after it can be checked
                verdicts += [Verdict(s, NOT_CHECKED) for s in range(pos, stop + 1)]
                break
            origins.append(step0)
            judged, broken = _judge(seen, step0, pos, stop)
            verdicts += judged
            if broken is None:
                break
            if broken.stage == SCORES:
                broken = replace(broken, sample=rescored.get(broken.step))
            verdicts.append(_classify(run_dir, ledger, broken, seen[broken.step], rescore))
            resume_at = next((n for n in snapshots if broken.step <= n < stop), None)
            resume_at = stop if resume_at is None else resume_at
            verdicts += [Verdict(s, NOT_CHECKED) for s in range(broken.step + 1, resume_at + 1)]
            pos = resume_at + 1
    now = produced_on(config)
    moved = {k: [recorded.get(k), now[k]] for k in now if recorded.get(k) not in (None, now[k])}
    return RerunReport(str(run_dir), [start, stop], origins[0], origins[1:], verdicts, moved, "verlj-source" in recorded,
                       ("rescored" if rescore_model else "kept") if reward_model else None)


def stage_values(run_dir: Path, step: int, stage: str) -> list[tuple[str, np.ndarray]]:
    """Re-execute `step` from the newest snapshot before it (its samples scored again with the rule
    reward the config names now, as rerun does) and return `stage`'s values there, as [(name, host
    array)] (this process's share). The steps replayed on the way must reproduce."""
    run_dir = Path(run_dir)
    with steps_reader(run_dir, step, step, f"step {step}") as ledger:
        step0, seen = _execute(run_dir, ledger, step, step, keep=True, rescore="rule")
    _judge({s: v for s, v in seen.items() if s < step}, step0, step, step - 1)
    return (seen[step].kept or {}).get(stage, [])


def diff_stages(run_a: Path, run_b: Path, full: bool = False) -> Difference:
    """`verlj diff --stages`: diff.first_difference, and where the first differing stage is one
    the journal holds only digests of (log-probs, advantages, loss, gradients, state), both runs'
    step re-executed from their snapshots to name the first differing element."""
    from ..state.stages import first_element_difference
    from .diff import JOURNALED_STAGES, first_difference

    d = first_difference(run_a, run_b, full)
    st = d.detail.stages
    if st is not None and st.stage not in JOURNALED_STAGES:
        assert d.step is not None  # a stage differs at a step
        d = d.reexecuted(first_element_difference(stage_values(run_a, d.step, st.stage), stage_values(run_b, d.step, st.stage)))
    return d


def _judge(seen: dict[int, Observed], step0: int, pos: int, stop: int) -> tuple[list[Verdict], Verdict | None]:
    """The verdicts of the steps pos..stop of one re-execution (from step0) that reproduced, and the
    first that differs (None: none did)."""
    verdicts: list[Verdict] = []
    for step in range(step0 + 1, stop + 1):
        seen_here = seen[step]
        stage = seen_here.first_difference()
        if step < pos:  # re-executed on the way to the range, not judged
            if stage is not None:
                raise RunError(f"step {step}, re-executed on the way to step {pos}, does not reproduce (it differs at {stage}): "
                               f"start --steps at {step} to see it")
            continue
        if stage is None:
            verdicts.append(Verdict(step, REPRODUCED))
            continue
        journaled = seen_here.journaled.summary.get(stage, {}) if seen_here.journaled is not None else {}
        return verdicts, Verdict(step, DIFFERS, stage, journaled, seen_here.rerun.summary.get(stage, {}))
    return verdicts, None


def _classify(run_dir: Path, ledger: Ledger, broken: Verdict, first: Observed, rescore: str | None = None) -> Verdict:
    """Execute the differing step a second time: persistent when both re-executions agree, else transient."""
    _, second = _execute(run_dir, ledger, broken.step, broken.step, rescore=rescore)
    again = second[broken.step]
    assert broken.stage is not None  # a step that differs names its stage
    return replace(broken, kind=PERSISTENT if first.same_as(again) else TRANSIENT, second=again.rerun.summary.get(broken.stage, {}))


def render(report: RerunReport | dict) -> str:
    """The report as text (`report`: a RerunReport, or its JSON form as `verlj rerun --json` printed it)."""
    if isinstance(report, dict):
        report = RerunReport.from_dict(report)
    lines = []
    moved = report.versions_changed
    cause = cross_hardware({k: a for k, (a, _) in moved.items()}, {k: b for k, (_, b) in moved.items()}, "rerun")
    if cause is not None and not report.reproduced:
        lines.append(f"the run was {cause}")
    for v in report.verdicts:
        if v.verdict == REPRODUCED:
            lines.append(f"step {v.step}: reproduced")
        elif v.verdict == NOT_CHECKED:
            lines.append(f"step {v.step}: not checked ({v.note or 'the state it starts from already differs'})")
        else:
            j, r = _Summary.of(v.journaled), _Summary.of(v.rerun)
            nums = (f" (journal: mean {j.mean:.9g}, |max| {j.absmax:.9g}; rerun: mean {r.mean:.9g}, |max| {r.absmax:.9g})"
                    if j and r else "")
            kind = v.kind
            why = ""
            if kind == PERSISTENT:
                if moved:
                    why = " — " + ", ".join(f"{k}{':' if ' module ' in k else ''} {a} → {b}" for k, (a, b) in moved.items())
                elif report.source_recorded:
                    why = (" — the same code and versions give another result than the run did: the run's own execution "
                           "of this step went wrong (suspect the machine that ran it), or the platform changed")
                else:
                    why = " — no recorded version changed: the code or the platform did"
            elif kind == TRANSIENT:
                why = " — a second re-execution here gave another result: suspect the hardware"
            lines.append(f"step {v.step}: differs at {v.stage}{nums}{', ' + kind if kind else ''}{why}")
            x = v.sample
            if x:
                lines.append(f"  first sample scored otherwise: sample {x.id} (dataset row {x.index}): "
                             f"journal {x.journaled!r}, rerun {x.rerun!r}")
    src = f"snapshot step_{report.from_snapshot:05d}" if report.from_snapshot else "the initial state"
    if report.restarted_from:
        src += ", and after each difference from " + ", ".join(f"step_{s:05d}" for s in report.restarted_from)
    if report.reward_model == "kept":
        lines.append("the reward model did not score the samples again (its journaled scores were kept): "
                     "pass --rescore-model to re-score them (a forward pass per sample)")
    ok = sum(v.verdict == REPRODUCED for v in report.verdicts)
    lines.append(f"{ok} of {len(report.verdicts)} step(s) reproduced (re-executed from {src})")
    return "\n".join(lines)
