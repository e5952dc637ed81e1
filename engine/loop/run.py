"""`verlj train` (a fresh run, or --resume), the train loop, `replay --fork`'s and `whatif`'s new run.

    verlj train --output-dir runs/demo [--resume] [key=value ...]

    RUN/
      journal/              the LMDB journal (source of truth; loop.ledger reads and writes its history)
      writer/               the writers' claims on the run (journal.claim): one writer at a time
      config.yaml           the effective config of the latest start
      step_00050/ ...       snapshots (loop.checkpointer, laid out by loop.snapshot_store)
      latest -> step_00050  the newest published snapshot
      train_metadata.json   a human-readable mirror of the ledger
      metrics.jsonl         one line per step (logging.jsonl)
      tensorboard/, wandb/  TensorBoard's and W&B's files (logging.tensorboard, logging.wandb)
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from verlj.journal import Claim, Journal, open_journal_reader
from verlj.journal.failpoints import failpoint

from ..config import ONE_OFF_KEYS, Config, changed_config, config_from_dict, diff_configs, make_config, stored_config, to_yaml
from ..errors import ConfigError, RunError, UsageError
from ..report import Reporter
from ..rl.faults import FaultStop
from ..schema.events import Control, ControlKind
from . import whatif
from .context import Run
from .ledger import (
    WRITER_DIR,
    Ledger,
    check_local_dir,
    claim_run,
    discard_journal,
    git_commit,
    has_run,
    journal_dir,
    lost_journal,
    now_iso,
    open_run,
    open_writer,
    run_state,
    shipped_config,
    stage_local_journal,
    writer_refusal,
)
from .ledger.identity import RUN_TOKEN
from .ledger.in_flight import Carried, carry_tools, unstarted_tools
from .provenance import produced_on
from .standby import Prebuilt, trainer_for

if TYPE_CHECKING:  # torch and DeepSpeed load only once the config is known good: bad input fails fast
    from ..dist import Runtime

# what `verlj train` writes at the top of a run directory besides snapshots (loop.snapshot_store)
RUN_FILES = ("journal", "config.yaml", "metrics.jsonl", "train_metadata.json", "tensorboard", "wandb")


@dataclass
class Trained:
    """What `verlj train` ended with: the last committed step, and (None when none did) one line on
    the snapshots that failed, which the CLI prints and exits non-zero on (the run itself is whole)."""

    last: int
    snapshots_failed: str | None = None


@dataclass
class StopFlag:
    """SIGINT/SIGTERM: the first finishes the current step, commits and snapshots; a second stops at once."""

    requested: bool = False
    signal_name: str = ""

    def install(self) -> None:
        def handler(signum, _frame):
            if self.requested:
                raise KeyboardInterrupt  # second signal: stop now (the journal holds only whole steps)
            self.requested = True
            self.signal_name = signal.Signals(signum).name

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def resolve_config(run_dir: Path, state: str, config_file, overrides, resume: bool, allow_change: bool) -> tuple[Config, list[str], str | None]:
    """The config to run with. Returns (cfg, changed keys, a note to print).

    Resuming a run: the config in force at its last step, then the file and overrides on top, checked
    by the fields' own resume policies. Resuming a run that never committed a step: its stored config
    (nothing was trained, so anything may change on top of it; the note names what did). Otherwise
    the file and overrides on the defaults."""
    if state == "run" and resume:
        with Ledger.open_reader(run_dir) as ledger:
            last = ledger.last_step()
            stored = ledger.config_at(last)
        cfg, changed = changed_config(stored, config_file, overrides, allow_change, "resume")
        if cfg.trainer.total_steps < last:  # a resume only goes forward: it would train nothing, silently
            raise ConfigError(f"trainer.total_steps={cfg.trainer.total_steps} is below step {last}, where {run_dir} already is: "
                              f"a resume only goes forward (to branch off at an earlier step: verlj replay {run_dir} "
                              f"--to-step {cfg.trainer.total_steps} --fork NEW_RUN)")
        return cfg, changed, None
    if state != "empty":
        return make_config(config_file, overrides), [], None
    said = f"{run_dir} held a run that never committed a step; starting it afresh"
    unstarted = unstarted_config(run_dir) if resume else None
    if unstarted is None:
        return make_config(config_file, overrides), [], said + ("." if not resume else " (no config of it was stored).")
    cfg = make_config(config_file, overrides, base=unstarted)
    changed = [k for k in diff_configs(config_from_dict(unstarted).to_dict(), cfg.to_dict()) if k not in ONE_OFF_KEYS]
    return cfg, [], said + " with its stored config" + (f", changed by this command in {', '.join(changed)}." if changed else ".")


def unstarted_config(run_dir: Path) -> dict | None:
    """The config a run that never committed a step was started with: from its journal, else from the
    config.yaml its start wrote; None when neither holds one."""
    if has_run(run_dir):
        with Ledger.open_reader(run_dir) as ledger:
            return ledger.identity.first_config()
    path = Path(run_dir) / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return stored_config(data) if isinstance(data, dict) else None


def stage_resume_journal(run_dir: Path, config_file, overrides) -> None:
    """A resume of a shipped run on a node without its local journal: the journal is rebuilt from the
    segments once, where the config it resumes with puts journal.local_dir, before anything reads
    the run; every reader of this process opens that copy and the writer renames it into place (one
    read of the segments, no copy). Rank 0 only: the other ranks read as before."""
    if os.environ.get("RANK", "0") != "0" or (stored := shipped_config(run_dir)) is None:
        return
    try:
        local_dir = make_config(config_file, overrides, base=stored).journal.local_dir
    except ConfigError:
        return  # resolve_config says what is wrong with it
    if local_dir is not None:
        stage_local_journal(run_dir, local_dir)


def train(
    output_dir: str | Path,
    config_file: str | Path | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    resume: bool = False,
    allow_config_change: bool = False,
    prebuilt: Prebuilt | None = None,
) -> Trained:
    """`verlj train`: a fresh run, or `--resume` of an existing one (`prebuilt`: a standby's trainer, loop.standby).
    Returns the last committed step and what failed of its snapshots."""
    run_dir = Path(output_dir)
    state, cfg, changed, said = check_start(run_dir, config_file, overrides, resume, allow_config_change)
    existing = state == "run"

    from ..dist import configure_determinism, prepare_accelerator, setup

    prepare_accelerator()
    from .checkpointer import make_run

    rt = setup(cfg)
    configure_determinism(cfg)
    preflight_rollout(cfg, rt)
    created = not run_dir.exists()
    journal = trainer = reporter = source = run = None
    claim: Claim | None = None
    notes: list[str] = []
    interrupted = False
    stop = StopFlag()
    stop.install()

    def open_journal() -> Journal:
        nonlocal claim
        run_dir.mkdir(parents=True, exist_ok=True)
        claim = claim_run(run_dir, cfg.journal, notes.append)  # refuses a second writer before anything is touched
        carried = restart_afresh(run_dir) if state == "empty" else None  # died before its first step: start it afresh
        j, more = open_writer(run_dir, cfg.journal, claim)
        notes.extend(carry_tools(j, carried))
        notes.extend(more)
        return j

    try:
        if existing:  # lock an existing run before anything else
            journal = rt.from_rank0(open_journal, "opening the journal", share=False)
        trainer = trainer_for(cfg, rt, prebuilt, notes.append)  # models, data, rewards: bad input fails here, before a fresh run is written
        if not existing:
            journal = rt.from_rank0(open_journal, "opening the journal", share=False)
        reporter = Reporter(cfg.logging, run_dir, rt.is_main, cfg.trainer.total_steps)
        greet(reporter, notes, said or (f"No run in {run_dir} yet: starting a new one (--resume continues a run when there is "
                                        "one)." if resume and not existing else None))
        run = make_run(run_dir, rt, trainer, reporter, Ledger(journal) if journal is not None else None)
        last, control, source = begin(run, existing, changed, allow_config_change)
        last = train_loop(run, last, control, stop, source)
        return Trained(last, run.ckpt.failures())
    except FaultStop as e:
        if not unstarted(claim, state, journal):
            raise
        # nothing of the run is kept, so there is nothing to --resume (which would start the defaults): the same command
        again = partial(start_command, run_dir, config_file, overrides, resume)
        raise FaultStop(e.step, e.summary, f"Nothing of the run was kept; fix it and start it again with `{again()}`, or with "
                        f"`{again(fault_rate=True)}` to train past the faults and read each one with `verlj inspect {run_dir} "
                        f"--step {e.step}`") from None
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, waiting for nothing in flight
        interrupted = True
        raise
    finally:
        if source is not None:
            source.close()
        if reporter is not None:
            reporter.close()
        discard = unstarted(claim, state, journal)
        if journal is not None:
            journal.close()
        elif claim is not None:
            claim.release()
        if run is not None:
            run.source.close(at_once=interrupted)
        if trainer is not None:
            trainer.close()
        if discard:
            discard_unstarted(run_dir, remove_dir=created)


def unstarted(claim: Claim | None, state: str, journal: Journal | None) -> bool:
    """Whether a start made a run that never committed a step, which it removes as it ends, leaving nothing to block a
    retry: only a new run of this process's own (it claimed it and still holds it; a refused or taken-over start touches
    nothing). A run that was there before (`state`) and never committed a step stays, with this start's config, for a
    --resume to start afresh with."""
    owned = claim is not None and not claim.taken_over()
    return owned and state == "none" and (journal is None or journal.last_step() == 0)


def start_command(run_dir: Path, config_file, overrides, resume: bool, fault_rate: bool = False) -> str:
    """A start's command, to paste (`fault_rate`: with rollout.max_fault_rate=1 in place of any it named)."""
    over = [o for o in overrides if not (fault_rate and o.split("=", 1)[0].strip() == "rollout.max_fault_rate")]
    return shlex.join(["verlj", "train", "--output-dir", str(run_dir), *(["--config", str(config_file)] if config_file else []),
                       *(["--resume"] if resume else []), *over, *(["rollout.max_fault_rate=1"] if fault_rate else [])])


def check_start(run_dir: Path, config_file, overrides, resume: bool, allow_change: bool) -> tuple[str, Config, list[str], str | None]:
    """What `verlj train` may do in `run_dir`, checked before anything loads or is written: one sentence
    when it may not. Returns (its run_state, the config, the changed keys, a note to print)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--output-dir {run_dir} exists and is not a directory")
    lost = lost_journal(run_dir)  # a past run without its journal: never taken for one that never started
    if lost is not None:
        raise RunError(lost)
    if resume:
        stage_resume_journal(run_dir, config_file, overrides)
    state = run_state(run_dir)
    existing = state == "run"
    if existing and not resume:
        raise RunError(writer_refusal(run_dir) or f"{run_dir} already holds a run; pass --resume to continue it, or choose "
                       "another --output-dir")
    if state == "none" and run_dir.exists() and any(run_dir.iterdir()):
        raise RunError(f"{run_dir} is not a verlj run and is not empty (no journal/ with run metadata); "
                       "choose an empty or new --output-dir")
    cfg, changed, said = resolve_config(run_dir, state, config_file, overrides, resume, allow_change)
    if cfg.trainer.resume_from not in (None, "auto") and not existing:
        raise RunError(f"trainer.resume_from is {cfg.trainer.resume_from!r} but {run_dir} holds no run")
    check_local_dir(run_dir, cfg.journal)
    return state, cfg, changed, said


def greet(reporter: Reporter, notes: list[str], said: str | None) -> None:
    """A start's first lines: the notes from opening the journal, the stale weight copies removed
    (every rank: its node's /dev/shm), and what the config resolution had to say."""
    from ..rl.vllm_engine import remove_stale_weights_copies

    for note in notes:
        say(reporter, note)
    for line in remove_stale_weights_copies():
        reporter.info(line)
    if said:
        reporter.info(said)


def begin(run: Run, existing: bool, changed: list[str], allow_change: bool) -> tuple[int, list[dict], whatif.WhatifSource | None]:
    """Resume an existing run (recovery.resume) or record a new one's start. Returns (the last step, the
    control events of the first step's record, what collects a what-if's steps: None for a run trained
    on its own samples)."""
    from .recovery import resume

    rt, reporter = run.rt, run.reporter
    if not existing:
        if rt.is_main:
            run.main_ledger().start(run_identity(run))
        reporter.info("Step 0: Starting training...")
        return 0, [Control(ControlKind.START, {"config_hash": run.cfg.hash(), "world_size": rt.world_size}).to_event()], None
    rt.from_rank0(lambda: run.trainer.check_identity(run.main_ledger().identity.loaded()), "checking the run's identity")
    counterfactual = rt.from_rank0(lambda: run.main_ledger().identity.counterfactual(), "reading the run's identity")
    # a what-if goes on training on its parent's samples
    source = whatif.resume_source(run, counterfactual, changed) if counterfactual is not None else None
    try:
        last, control = resume(run, changed, allow_change)
        if rt.is_main:
            reporter.catch_up(run.main_ledger().metrics, last)
    except BaseException:
        if source is not None:
            source.close()
        raise
    return last, control, source


def restart_afresh(run_dir: Path) -> Carried | None:
    """Discard what a start that never committed a step wrote, keeping what its journal held of tool calls in flight
    (rollout.tools: their effects are the world's; ledger.in_flight.unstarted_tools) to carry into the new journal."""
    try:
        with Ledger.open_reader(run_dir) as ledger:
            carried = unstarted_tools(ledger.journal)
    except Exception:  # noqa: BLE001 - a journal killed in its first breath: nothing of it to carry
        carried = None
    discard_unstarted(run_dir)
    return carried


def discard_unstarted(run_dir: Path, remove_dir: bool = False) -> None:
    """Remove what a start that never committed a step wrote (only verlj's own names). The caller holds
    (or held, and has just released) the run's writer claim; the claims go only with the directory."""
    from .snapshot_store import SnapshotStore

    for name in RUN_FILES:  # the journal last: a kill in between leaves a run that never started, not a lost journal
        if name == "journal":
            continue
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for name in SnapshotStore(run_dir, None).temporaries():
        shutil.rmtree(run_dir / name, ignore_errors=True)
    discard_journal(run_dir)
    if remove_dir and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {WRITER_DIR}:
        shutil.rmtree(run_dir)


def train_loop(run: Run, last: int, control: list[dict], stop: StopFlag | None = None, source=None) -> int:
    """Live steps last+1 .. total_steps: collect, apply, commit, maybe snapshot. Returns the last step.
    `control`: events for the first step's record (start, resume, fork, a config change). `source`: what collects
    each step's inputs in place of the run's rollout source: a what-if's reader of another run's journal
    (loop.whatif.WhatifSource), whose samples passed their fault check and are never evaluated on."""
    from ..rl import faults
    from ..rl.rollout import engine_metrics
    from ..schema.sample import Columns

    cfg, rt, trainer, ckpt, ledger, reporter = run.cfg, run.rt, run.trainer, run.ckpt, run.ledger, run.reporter
    stop = stop or StopFlag()
    collect = source or run.source  # a what-if reads its parent's steps where the run's source would collect
    if rt.is_main:
        (run.run_dir / "config.yaml").write_text(to_yaml(cfg, stored=True))
    reporter.start(last + 1)
    if not rt.all_true(not stop.requested):  # a signal during the resume's replay: stop there, train nothing new
        reporter.info(f"Received {stop.signal_name or 'a stop signal'} during the resume: its replay reached step {last}; "
                      "nothing new trained; exiting.")
        return last
    if last >= cfg.trainer.total_steps:
        reporter.info(f"Step {last}: already at trainer.total_steps={cfg.trainer.total_steps}; nothing to train.")
    step, ship_cpu = last, 0.0
    for step in range(last + 1, cfg.trainer.total_steps + 1):
        t_step = time.perf_counter()
        inputs = collect.collect(step)  # async: also starts generating a later step's batch ...
        if not inputs.admitted:  # a what-if's step, read from its parent's journal: its batches enter the buffer as replay's
            run.source.replayed(inputs)
        samples = trainer.take(step, inputs)
        ckpt.settle()  # an async snapshot's write of the state the update is about to change
        outcome = trainer.apply(step, inputs, samples)
        run.source.weights_changed()  # the engine generates from the weights the update made, once the next sync brings them
        inputs = collect.finish_collect(step, inputs)  # ... which is in the buffer, and in this record, before the commit
        generated = Columns(inputs.added).samples()
        if source is None:  # past rollout.max_fault_rate: one line, nothing of the step committed (a what-if's samples passed it)
            faults.check(step, generated, cfg.rollout.max_fault_rate, run.run_dir)
        outcome.metrics.update(run.source.in_flight())
        evaluated, eval_note = [], ""
        if source is None and trainer.eval_due(step):
            t_eval = time.perf_counter()
            eval_metrics, eval_event, eval_note = trainer.evaluate(step)
            outcome.metrics.update(eval_metrics, **{"timing_s/eval": time.perf_counter() - t_eval})
            evaluated = [eval_event]
        outcome.metrics.update(inputs.timings)
        outcome.metrics.update(engine_metrics(run.source.engine))  # the fleet's deaths, groups asked again, live actors
        outcome.metrics.update({"timing_s/step": time.perf_counter() - t_step}, **ckpt.mirror_timing())
        due = ckpt.due(step, outcome.metrics)
        failpoint("step.before_commit")  # the update is done, the journal does not know it yet
        t_commit = time.perf_counter()
        events = control + inputs.events() + outcome.events() + evaluated
        rt.from_rank0(lambda: run.main_ledger().journal.writer.append_step(step, events), f"the journal commit of step {step}")
        control = []
        # the commit's own time cannot be in the record it commits: it goes to the logs only
        logged = {**outcome.metrics, "timing_s/commit": time.perf_counter() - t_commit}
        shipper = ledger.journal.shipping.shipper if ledger is not None else None
        if shipper is not None:
            logged.update({"journal/ship_lag_steps": shipper.lag(), "timing_s/ship_cpu": shipper.cpu_seconds - ship_cpu})
            ship_cpu = shipper.cpu_seconds
        reporter.step(step, logged, " ".join(filter(None, [faults.note(generated), eval_note])))
        stopping = not rt.all_true(not stop.requested)  # every rank stops after the same step
        ckpt.after_step(step, outcome.fingerprint, due or stopping or step == cfg.trainer.total_steps)
        if stopping:
            ckpt.finish()
            reporter.info(f"Received {stop.signal_name or 'a stop signal'}: step {step} committed and snapshot taken; exiting.")
            break
    ckpt.finish(finished=step >= cfg.trainer.total_steps)
    if rt.is_main:
        ckpt.write_metadata(step)
    return step


def fork_config(old: dict, overrides: list[str], new_run: Path) -> tuple[Config, list[str]]:
    """A fork's config: `old` (the parent's at the fork's step) with the overrides, checked. Returns
    (config, changed keys)."""
    cfg, changed = changed_config(old, None, overrides, allow_live=True, how="fork")
    check_local_dir(new_run, cfg.journal)
    return cfg, changed


def check_fork(parent: Path, step: int, new_run: Path, overrides: list[str]) -> None:
    """`replay --fork`'s config, checked before anything is replayed (fork() checks it again on the
    replayed trainer's config, which may differ only in topology keys). A what-if is never forked."""
    with open_run(parent) as ledger:
        whatif.refuse_counterfactual(ledger, parent, "forked", "fork")
        fork_config(ledger.config_at(step), overrides, new_run)


def fork(replayed, parent: Path, new_run: Path, overrides: list[str]) -> int:
    """`replay --fork`: a new run from a materialized state (post_mortem.materialize); its journal records
    the parent run and step."""
    rt, trainer = replayed.run.rt, replayed.run.trainer
    cfg, changed = fork_config(trainer.cfg.to_dict(), overrides, new_run)
    preflight_rollout(cfg, rt)
    trainer.set_config(cfg)
    run = None
    try:
        run, base_fp = start_child(replayed, parent, new_run, cfg)
        run.ckpt.save(replayed.step, base_fp)  # the fork's base: recovery of the new run starts here
        run.ckpt.wait()
        control = [Control(ControlKind.FORK, {"parent": str(parent), "parent_step": replayed.step, "config_changes": changed}).to_event()]
        run.reporter.info(f"Forked {parent} at step {replayed.step} into {new_run}.")
        return train_loop(run, replayed.step, control)
    finally:
        close_child(run, trainer)


def start_whatif(replayed, parent: Path, new_run: Path, overrides: list[str], to_step: int) -> int:
    """A new what-if run from a materialized state of `parent` (post_mortem.materialize): its journal
    continues the parent's chain after the state's step and says it is counterfactual; then steps
    up to `to_step` trained on the parent's samples. Returns the last committed step."""
    trainer = replayed.run.trainer
    cfg, changed = whatif.whatif_config(trainer.cfg.to_dict(), overrides, to_step, new_run)
    trainer.set_config(cfg)
    trainer.rescore(list(trainer.buffer.samples.values()))  # samples waiting from before the what-if: its reward too
    counterfactual = {"run": str(parent.resolve()), "from_step": replayed.step, "to_step": to_step,
                      "overrides": list(overrides), "changed": changed}
    run = source = None
    try:
        run, base_fp = start_child(replayed, parent, new_run, cfg, counterfactual)
        source = whatif.WhatifSource(run, parent)
        run.ckpt.save(replayed.step, base_fp)  # the what-if's base: its recovery starts here
        run.ckpt.wait()
        control = [Control(ControlKind.WHATIF, {"parent": str(parent), "parent_step": replayed.step, "to_step": to_step,
                                                "config_changes": changed}).to_event()]
        run.reporter.info(f"What-if of {parent} from step {replayed.step} in {new_run}: steps {replayed.step + 1}–{to_step} "
                          f"re-trained on its samples{' with ' + ', '.join(changed) + ' changed' if changed else ''}.")
        return train_loop(run, replayed.step, control, source=source)
    finally:
        if source is not None:
            source.close()
        close_child(run, trainer)


def start_child(replayed, parent: Path, new_run: Path, cfg: Config, counterfactual: dict | None = None) -> tuple[Run, str]:
    """The new run of `replay --fork` or `whatif` around the replayed trainer (already under `cfg`):
    on rank 0, its journal, claimed and continuing `parent`'s hash chain after the replayed step (a
    what-if's identity says it is `counterfactual`). Returns (the run, its base fingerprint: the
    parent's state under `cfg`, which the caller snapshots as the run's base)."""
    from .checkpointer import make_run

    rt, trainer, step = replayed.run.rt, replayed.run.trainer, replayed.step
    # the base snapshot holds the state under the new config (an optimizer's lr is part of its state)
    base_fp, _ = trainer.state_fingerprint()
    ledger: Ledger | None = None
    notes: list[str] = []
    if rt.is_main:
        new_run.mkdir(parents=True, exist_ok=True)
        with open_journal_reader(journal_dir(parent)) as pj:
            chain = pj.chain_hash(step)
        journal, notes = open_writer(new_run, cfg.journal, claim_run(new_run, cfg.journal))
        ledger = Ledger(journal)
    try:
        run = make_run(new_run, rt, trainer, Reporter(cfg.logging, new_run, rt.is_main, cfg.trainer.total_steps), ledger)
    except BaseException:
        if ledger is not None:
            ledger.close()
        raise
    if rt.is_main:
        origin = {"run": str(parent.resolve()), "step": step, "fingerprint": replayed.fingerprint, "base_fingerprint": base_fp}
        run.main_ledger().start(run_identity(run), parent=origin, base_step=step, chain_base=chain, counterfactual=counterfactual)
        for note in notes:
            say(run.reporter, note)
    return run, base_fp


def close_child(run: Run | None, trainer) -> None:
    """Close what start_child opened (`run`: None when it failed) and the replayed trainer."""
    try:
        if run is not None:
            run.source.close()  # its rollout engine (vLLM, the async generator)
            run.reporter.close()
            if run.ledger is not None:
                run.ledger.close()
    finally:
        trainer.close()


def preflight_rollout(cfg: Config, rt: Runtime) -> None:
    """Before a run that generates writes anything: its rollout engine can run here, rollout.env
    (if named) can be imported and made (rl.envs.check_env), rollout.agent imported and rollout.tools opened."""
    from ..rl.envs import check_env
    from ..rl.rollout import engine_class

    engine_class(cfg.rollout.engine, cfg.rollout.mode, cfg.rollout.fleet).preflight(cfg, rt.device)
    if cfg.rollout.env is not None:
        check_env(cfg)
    if cfg.rollout.agent is not None:  # rollout.agent: importable (a command is found when it runs)
        from ..rl.gateway.agents import load_agent

        load_agent(cfg.rollout.agent)
    if cfg.rollout.tools:  # rollout.tools: importable, their MCP servers reachable (a command's started and stopped again)
        from ..rl.gateway.tools import open_tools

        open_tools(cfg.rollout.tools, cfg.rollout.tool_effects).close()


def run_identity(run: Run) -> dict:
    """What produced this run: recorded once at its start (loop.ledger keeps it)."""
    cfg, rt = run.cfg, run.rt
    return {
        "config": cfg.to_stored(),
        "config_hash": cfg.hash(),
        "seed": cfg.trainer.seed,
        "versions": produced_on(cfg.to_stored()),
        "world_size": rt.world_size,
        "tensor_parallel_size": rt.tp_size,
        "num_threads": cfg.trainer.num_threads,
        "created": now_iso(),
        "git_commit": git_commit(),
        "run_dir": str(run.run_dir.resolve()),
        # what names the run in its tool calls' idempotency keys: kept from an unstarted journal this one replaced (ledger.in_flight)
        RUN_TOKEN: run.main_ledger().identity.get(RUN_TOKEN) or secrets.token_hex(8),
        **run.trainer.identity(),
    }


def say(reporter: Reporter, note: str) -> None:
    """A one-line note from opening the journal: a warning when it starts with 'warning: '."""
    if note.startswith("warning: "):
        reporter.warn(note.removeprefix("warning: "))
    else:
        reporter.info(note)
