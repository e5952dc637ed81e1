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
the module's digest change (loop.ledger.user_modules) and the first sample scored otherwise.
Nothing is written into the run.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..dist import configure_determinism, setup
from ..errors import ReplayError, RunError, SnapshotError
from ..loop.ledger import Ledger, has_run, lost_journal, versions
from ..report import Reporter
from .materialize import replay_config


class StepsError(RunError):
    """--steps names no steps this run can re-execute: a usage error (exit 2)."""

    exit_code = 2


@dataclass
class Verdict:
    step: int
    verdict: str  # reproduced | differs | not checked
    stage: str | None = None  # the first stage that differs
    journaled: dict = field(default_factory=dict)  # that stage's summary in the journal
    rerun: dict = field(default_factory=dict)  # and in this re-execution
    kind: str | None = None  # persistent | transient (the first step that differs)
    sample: dict | None = None  # differs at scores: the first sample scored otherwise {id, index, journaled, rerun}
    second: dict = field(default_factory=dict)  # the second re-execution's summary of that stage
    note: str | None = None  # why a step was not checked, when not for the usual reason


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
             keep: bool = False, rescore: str | None = None, rescored: dict | None = None) -> tuple[int, dict]:
    """Restore the newest valid snapshot before `start`, re-execute the journaled steps up to `stop`;
    returns (snapshot step, {step: (journaled stages, rerun stages, journaled fingerprint, rerun fingerprint)}).
    `checked`: replay's own checks stay on (a probe runs on verified states) and nothing is observed;
    `before(step, inputs, samples, trainer)`: called before each step from `start` on; `keep`: each
    step's tuple also holds the stages' values (StepOutcome.kept). `rescore` ("rule", or "model": the
    reward model too): the samples of each step from `start` on are scored again with the reward the
    config names now (Trainer.rescore); `rescored[step]` then holds the first sample whose score
    changed: {id, index, journaled, rerun}."""
    from ..loop.checkpointer import make_run
    from ..loop.recovery import replay, restore
    from ..rl.trainer import Trainer

    cfg = replay_config(ledger, start)
    rt = setup(cfg)
    if not checked:  # digests compared bit for bit: only on the process group that made them
        for step in sorted({start, stop, *(e["from_step"] for e in ledger.history().topology_changes if start <= e["from_step"] <= stop)}):
            topo = ledger.topology_at(step)
            if (topo["world_size"], topo["tensor_parallel_size"]) != (rt.world_size, rt.tp_size):
                raise RunError(f"step {step} ran on {topo['world_size']} rank(s) with TP {topo['tensor_parallel_size']}, this is "
                               f"{rt.world_size} with TP {rt.tp_size}: its digests are compared on as many ranks "
                               f"(torchrun --nproc_per_node {topo['world_size']} -m verlj.cli ...)")
    configure_determinism(cfg)
    reporter = Reporter(cfg.logging, run_dir, enabled=False, total_steps=stop, sinks=False)
    trainer = Trainer(cfg, rt)
    try:
        run = make_run(run_dir, cfg, rt, trainer, reporter, ledger if rt.is_main else None)
        run.trainer.keep_stages = keep
        step0 = restore(run, start - 1)
        seen: dict = {}

        def observe(step, record, outcome) -> bool:
            seen[step] = ((record.first("stages") or {}), outcome.stages, record.fingerprint, outcome.fingerprint, outcome.kept)
            return True

        def pre(step, inputs, samples) -> None:
            if step < start:
                return
            if rescore is not None:
                journaled = [s.score for s in samples]
                run.trainer.rescore(samples, model=rescore == "model")
                moved = [(s, j) for s, j in zip(samples, journaled) if s.score != j]
                if moved and rescored is not None:
                    s, j = moved[0]
                    rescored[step] = {"id": int(s.id), "index": int(s.index), "journaled": j, "rerun": s.score}
            if before is not None:
                before(step, inputs, samples, run.trainer)

        if step0 < stop:
            replay(run, run.history(), step0 + 1, stop, observe=None if checked else observe,
                   before=pre if before or rescore else None)
        return step0, seen
    finally:
        trainer.close()


def rerun(run_dir: Path, start: int, stop: int, rescore_model: bool = False) -> dict:
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
        reward_model = bool((config.get("model", {}).get("reward_model") or {}).get("model_name_or_path"))
        pruned = [s for s in range(ledger.base_step() + 1, stop + 1) if ledger.journal.read_step(s).pruned]
        recorded = ledger.versions_in_force()
        snapshots = sorted(ledger.snapshots())
        verdicts: list[Verdict] = []
        origins: list[int] = []
        pos = start
        while pos <= stop:
            try:
                step0, seen = _execute(run_dir, ledger, pos, stop, rescore=rescore, rescored=rescored)
            except (ReplayError, SnapshotError) as e:
                if not origins:
                    raise
                verdicts += [Verdict(s, "not checked", note=f"the restart from the snapshot before it failed: {e}") for s in range(pos, stop + 1)]
                break
            late = [s for s in pruned if s > step0]
            if late:
                raise RunError(f"step {late[0]}'s samples were pruned from the journal (journal.retain_samples) and the newest "
                               f"snapshot before step {pos} is step {step0}: steps {step0 + 1}–{stop} cannot be re-executed")
            if origins and step0 != pos - 1:  # the restart snapshot did not load: nothing after it can be checked
                verdicts += [Verdict(s, "not checked") for s in range(pos, stop + 1)]
                break
            origins.append(step0)
            broken = _judge(seen, step0, pos, stop, verdicts)
            if broken is None:
                break
            if broken.stage == "scores":
                broken.sample = rescored.get(broken.step)
            _classify(run_dir, ledger, broken, seen[broken.step], rescore)
            resume_at = next((n for n in snapshots if broken.step <= n < stop), None)
            resume_at = stop if resume_at is None else resume_at
            verdicts += [Verdict(s, "not checked") for s in range(broken.step + 1, resume_at + 1)]
            pos = resume_at + 1
    now = versions(config)
    moved = {k: [recorded.get(k), now[k]] for k in now if recorded.get(k) not in (None, now[k])}
    return {"run": str(run_dir), "steps": [start, stop], "from_snapshot": origins[0], "restarted_from": origins[1:],
            "verdicts": [v.__dict__ for v in verdicts], "versions_changed": moved, "source_recorded": "verlj-source" in recorded,
            "reward_model": ("rescored" if rescore_model else "kept") if reward_model else None,
            "reproduced": all(v.verdict == "reproduced" for v in verdicts)}


def stage_values(run_dir: Path, step: int, stage: str) -> list[tuple[str, object]]:
    """Re-execute `step` from the newest snapshot before it (its samples scored again with the rule
    reward the config names now, as rerun does) and return `stage`'s values there, as [(name, host
    array)] (this process's share). The steps replayed on the way must reproduce."""
    run_dir = Path(run_dir)
    with steps_reader(run_dir, step, step, f"step {step}") as ledger:
        step0, seen = _execute(run_dir, ledger, step, step, keep=True, rescore="rule")
    verdicts: list[Verdict] = []
    _judge({s: v for s, v in seen.items() if s < step}, step0, step, step - 1, verdicts)
    return (seen[step][4] or {}).get(stage, [])


def diff_stages(run_a: Path, run_b: Path, full: bool = False) -> dict:
    """`verlj diff --stages`: inspection.first_difference, and where the first differing stage is one
    the journal holds only digests of (log-probs, advantages, loss, gradients, state), both runs'
    step re-executed from their snapshots to name the first differing element."""
    from ..state.stages import first_element_difference
    from .inspection import JOURNALED_STAGES, first_difference

    d = first_difference(run_a, run_b, full)
    st = d["detail"].get("stages")
    if st is not None and st["stage"] not in JOURNALED_STAGES:
        step, stage = d["step"], st["stage"]
        st["element"] = first_element_difference(stage_values(run_a, step, stage), stage_values(run_b, step, stage))
        st["reexecuted"] = True
    return d


def _judge(seen: dict, step0: int, pos: int, stop: int, verdicts: list) -> Verdict | None:
    """Verdicts for the steps pos..stop of one re-execution (from step0), up to the first that differs (returned)."""
    from ..state.stages import first_difference

    for step in range(step0 + 1, stop + 1):
        want, got, want_fp, got_fp, _ = seen[step]
        stage = first_difference(want, got) if want else None
        if stage is None and want_fp != got_fp:
            stage = "state"
        if step < pos:  # re-executed on the way to the range, not judged
            if stage is not None:
                raise RunError(f"step {step}, re-executed on the way to step {pos}, does not reproduce (it differs at {stage}): "
                               f"start --steps at {step} to see it")
            continue
        if stage is None:
            verdicts.append(Verdict(step, "reproduced"))
            continue
        v = Verdict(step, "differs", stage, want.get("summary", {}).get(stage, {}), got.get("summary", {}).get(stage, {}))
        verdicts.append(v)
        return v
    return None


def _classify(run_dir: Path, ledger: Ledger, broken: Verdict, first: tuple, rescore: str | None = None) -> None:
    """Execute the differing step a second time: persistent when both re-executions agree, else transient."""
    from ..state.stages import first_difference

    _, second = _execute(run_dir, ledger, broken.step, broken.step, rescore=rescore)
    again = second[broken.step][1]
    same = first_difference(first[1], again) is None and first[3] == second[broken.step][3]
    broken.kind = "persistent" if same else "transient"
    broken.second = again.get("summary", {}).get(broken.stage, {})


def render(report: dict) -> str:
    lines = []
    for v in report["verdicts"]:
        if v["verdict"] == "reproduced":
            lines.append(f"step {v['step']}: reproduced")
        elif v["verdict"] == "not checked":
            lines.append(f"step {v['step']}: not checked ({v.get('note') or 'the state it starts from already differs'})")
        else:
            j, r = v["journaled"], v["rerun"]
            nums = (f" (journal: mean {j['mean']:.9g}, |max| {j['absmax']:.9g}; rerun: mean {r['mean']:.9g}, |max| {r['absmax']:.9g})"
                    if j and r else "")
            kind = v["kind"]
            why = ""
            if kind == "persistent":
                moved = report["versions_changed"]
                if moved:
                    why = " — " + ", ".join(f"{k}{':' if ' module ' in k else ''} {a} → {b}" for k, (a, b) in moved.items())
                elif report["source_recorded"]:
                    why = (" — the same code and versions give another result than the run did: the run's own execution "
                           "of this step went wrong (suspect the machine that ran it), or the platform changed")
                else:
                    why = " — no recorded version changed: the code or the platform did"
            elif kind == "transient":
                why = " — a second re-execution here gave another result: suspect the hardware"
            lines.append(f"step {v['step']}: differs at {v['stage']}{nums}{', ' + kind if kind else ''}{why}")
            x = v.get("sample")
            if x:
                lines.append(f"  first sample scored otherwise: sample {x['id']} (dataset row {x['index']}): "
                             f"journal {x['journaled']!r}, rerun {x['rerun']!r}")
    src = f"snapshot step_{report['from_snapshot']:05d}" if report["from_snapshot"] else "the initial state"
    if report["restarted_from"]:
        src += ", and after each difference from " + ", ".join(f"step_{s:05d}" for s in report["restarted_from"])
    if report.get("reward_model") == "kept":
        lines.append("the reward model did not score the samples again (its journaled scores were kept): "
                     "pass --rescore-model to re-score them (a forward pass per sample)")
    ok = sum(v["verdict"] == "reproduced" for v in report["verdicts"])
    lines.append(f"{ok} of {len(report['verdicts'])} step(s) reproduced (re-executed from {src})")
    return "\n".join(lines)
