"""Fault-injection campaign: prove recovery and detection on the real `verlj` CLI.

    python tools/faults.py --kills 50 --corruptions 50 --seed 1       # the full campaign (~1 h on 2 cores)
    python tools/faults.py --quick                                    # a few trials of each kind (~2 min)

Every trial drives `verlj` in subprocesses on the default task with small settings, then compares
the run with an uninterrupted reference (`verlj diff --full` semantics: every step's data, seeds,
samples, metrics other than timings, and fingerprint). Kinds:

  kill         SIGKILL at a random moment, or at a failpoint (inside the journal commit, after it,
               mid snapshot write, before the snapshot's rename or indexing, during rotation), or
               during the replay of a resume; then `--resume` until the target step.
               exact | NOT EXACT
  corruption   byte flips, truncation or deletion in a random snapshot file or the journal's data
               file of a finished run; then `verlj verify` and `--resume` two steps further.
               recovered exactly | refused clearly | unaffected | SILENT | CRASH
  disk-full    the run directory on a small tmpfs, so a snapshot or a journal commit hits ENOSPC;
               then more space and `--resume`.
  node-loss    journal.local_dir with one snapshot kept (every save rotates), retention and the archive
               on or off, shipped segments compacted all along (segment_fanout 2) or not: SIGKILL at a
               random moment, mid shipment, or, with shipping slowed (a slow shared filesystem), at a
               failpoint of publish / index / rotate / prune / archive / segment compaction; then
               the local journal deleted (the node is gone), sometimes the last segment torn or
               bit-flipped too; then `--resume` with a new local directory. exact (no more steps
               lost than the lag bound allows, nothing the shipped journal names deleted, the resume
               starting from the newest snapshot whose step was shipped or a newer one) | NOT EXACT
               | BOUND EXCEEDED | SNAPSHOT LOST
  concurrency  a second `verlj train` on a live run; `inspect` and `verify` during training.
  two-writers  two trainers on one shipped run from two local directories, the second started at a
               random moment, with or without --resume: refused (one line naming the live writer,
               the run's files untouched, the first run exact) | NOT REFUSED | TOUCHED | NOT EXACT
  async        rollout.mode=async (max_staleness 1 or 4; --async-order step, completion or both, which
               alternates; the generator on verlj's sampler, or on vLLM with --async-engine vllm):
               SIGKILL of the trainer's process group or of the trainer alone at a random moment, at
               a failpoint of generator start / admit / push / consume / commit, or of the generator
               process alone; then `--resume` until the target step. Step order: exact (bit-identical
               to the uninterrupted run; completed samples lost, prompts trained more or fewer times,
               counted against it) | NOT EXACT. Completion order (the generator slowed, so groups are
               in flight at every commit): exact when no committed step changed, `verify --deep`
               passes (every fingerprint replayed, every group accounted for), the prompts were asked
               in the dataset's order, and the groups asked again after a kill carry the version the
               resume held | NOT EXACT
  bitflip      silent data corruption: one mantissa bit flipped in the actor's gradients (before the
               optimizer step) or in its parameters (after the update) during one step of a clean run
               (ZeRO 0-3, failpoints update.grads / update.params); then `verlj rerun` over every step.
               found (that step, at stage `grads` / `state`, and every other step re-executed
               reproduced) | MISSED | WRONG STAGE | FALSE ALARM. Counts the clean steps re-executed.
  episodes     multi-turn episodes (rollout.env=builtin:guess, max_turns 3; GRPO or PPO): sync, async
               step order or async completion order (the generator slowed), killed as the async kind
               kills (random SIGKILLs of the trainer alone or with its generator, a failpoint, the
               generator alone), and in completion order also at the failpoints on either side of a
               turn's durable write (episodes.before_durable / after_durable); then `--resume` until the
               target step. Sync and step order: exact (bit-identical to the uninterrupted run) | NOT
               EXACT. Completion order: exact when the completion kind's checks pass and every episode
               in flight at a kill went on from its durable turns (its trained sample begins with them)
               | NOT EXACT. Counts the durable turns resumed.
  effects      rollout.tools (agents whose tool calls have effects outside the episode: tests/tools_for_tests.py's services
               append each effect they apply to a file): an agent (tests/agents_for_tests.py:ticketing) calls a tool through the
               gateway's MCP server every episode, in sync, async step or completion order, the tool keyed with a reconcile
               (open_ticket) or keyless without one (post_message); SIGKILL at a random moment or at a failpoint around a tool
               call (tools.after_sent: sent, not run; tools.after_run: applied, its result not durable; tools.after_done);
               then `--resume` until done. exact: no effect applied twice; the keyed service never even sent a key twice;
               every unresolved episode (keyless: its outcome unknown) left out of the update and counted; sync and step
               order bit-identical to the uninterrupted run (keyed: every step's fingerprint) or its committed steps
               unchanged by the kills (completion order) | DUPLICATED | NOT EXACT. Counts calls answered from the journal,
               reconciled, and unresolved episodes.
  mirror       trainer.mirror_interval=1, trainer.save_interval=4 (the state after every committed step mirrored in the background into a
               directory of the campaign's, as into /dev/shm): 1-3 SIGKILLs at random moments (in a step, in a
               mirror's copy, in a resume that is loading a mirror or replaying), or one at a failpoint of the
               mirror's write (mirror.held: the live tensors held, none written; mirror.mid_write: its files written,
               not published) or in a resume's replay; then `--resume` until the target step. exact (every step's events
               and fingerprint equal to the uninterrupted run's, which mirrors nothing) | NOT EXACT. Counts the resumes
               that loaded a mirror, a snapshot from disk, or the initial state.
  partial      partial rollouts (rollout.partial: async completion order, generations span weight updates;
               the generator slowed to 10 ms a token so that every push stops some), killed as the async
               kind kills, or at the failpoints on either side of a push's durable write
               (partial.before_durable / after_durable); then `--resume` until the target step. exact
               when the completion kind's checks pass, every group a resume asked that had durable
               tokens went on from them (none from its start), and each such group's trained samples
               begin with those tokens, ids and log-probs bit for bit, with their versions | NOT EXACT.
               Counts the durable tokens taken up.
  bad-input    malformed configs, wrong overrides, missing paths, a newer-schema journal, a
               directory that is not a run: one line, non-zero exit, no traceback, nothing written.
  operator     an operator's hands on a run (its journal in the run or in journal.local_dir), after a
               SIGKILL at a random moment or between runs: `cp -a` of the run then --resume of the copy,
               `mv` of the run, `rm -rf` of one or two snapshot directories, `journal/` lost,
               train_metadata.json lost; then --resume and verify. exact (the copy or the moved run
               resumed exactly, the copy's original untouched and still exact; no valid snapshot
               quarantined or deleted but by rotation) | refused clearly (journal lost: one line,
               nothing moved) | SILENT | SNAPSHOT LOST | NOT EXACT
  fleet        rollout.fleet=ray (two generator actors on a local Ray cluster the campaign starts once and
               stops at the end) with trainer.max_restarts=3, so the run finishes by itself; async_order
               alternates step / completion. SIGKILL of one actor's process (at a random moment, found
               among this cluster's ray::GeneratorActor processes, or at the failpoint
               fleet.dispatch:N:kill-actor), of the trainer (the supervisor's child, not the supervisor)
               at a random moment, or both (an actor, then the trainer). Step order: exact (every step's
               events and fingerprint equal to the uninterrupted fleet run's, the rollout/fleet/*
               counters and timings aside) | NOT EXACT. Completion order: accounted (as async's
               completion order: `verify --deep`, every group asked once, arrived once, trained or
               dropped, the dataset's order, the version resumed with) | NOT ACCOUNTED. DID NOT FINISH
               when the supervised run does not complete. Needs ray; a trial took 1 to 5 minutes (2.7 on
               average) on 2 cores shared with other jobs (every run starts a trainer and two actors, a
               kill of the trainer another), so --quick leaves it out unless --kinds names it.

Exit status 1 if any trial is NOT EXACT, SILENT, CRASH or otherwise failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = [sys.executable]  # what runs `-m verlj.cli ...` (--python)
TARGET = 8
SMALL = [
    f"trainer.total_steps={TARGET}", "trainer.save_interval=2", "trainer.save_total_limit=2",
    "data.prompts_per_step=4", "rollout.n=2", "rollout.max_response_length=4", "algorithm.dynamic_sampling=true",
    "model.actor.micro_batch_size=4", "logging.progress=lines",
]
FAILPOINTS = {
    "journal.before_commit": TARGET, "journal.after_commit": TARGET - 1, "step.before_commit": TARGET,
    "snapshot.mid_write": 4, "snapshot.before_rename": 4, "snapshot.before_index": 4, "snapshot.rotate": 2,
}
# node loss, with shipping slowed: kill at one of these (its hit count drawn from 1..n)
NODE_LOSS_POINTS = {"snapshot.before_rename": 3, "snapshot.before_index": 3, "snapshot.rotate": 3, "snapshot.before_delete": 3,
                    "snapshot.rotated": 3}
RETENTION_POINTS = {"journal.prune": 3, "archive.mid_write": 6}
COMPACTION_POINTS = {"compact.before_publish": 4, "compact.after_publish": 4, "compact.delete": 4}  # with segment_fanout 2
SLOW_SHIPPING = "ship.before_publish:1:sleep-each=0.3"
KINDS = ("kill", "corruption", "disk-full", "node-loss", "concurrency", "two-writers", "async", "bitflip", "bad-input", "operator", "fleet", "episodes",
         "partial", "effects", "mirror")
GOOD = {"exact", "found", "recovered exactly", "refused clearly", "unaffected", "stopped clearly, resumed exactly", "kept going without snapshots",
        "refused", "undisturbed", "clear error", "accounted"}


@dataclass
class Trial:
    kind: str
    n: int
    what: str
    outcome: str
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in GOOD


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VERLJ_FAILPOINT")}
    e.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def verlj(*args, timeout=600, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON[0], "-m", "verlj.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(**extra), cwd=REPO)


def train(run: Path, *over, resume=True, **extra) -> subprocess.CompletedProcess:
    return verlj("train", "--output-dir", run, *SMALL, *over, *(["--resume"] if resume else []), **extra)


def clean_error(out: subprocess.CompletedProcess) -> bool:
    text = out.stdout + out.stderr
    return out.returncode not in (0,) and out.returncode > 0 and "Traceback" not in text and out.stderr.count("error:") == 1


def _journal():
    import verlj.engine  # noqa: F401  (declares verlj's event types to the journal)
    from verlj.journal import Journal, verify_journal

    return Journal, verify_journal


def identical(run: Path, ref: Path) -> tuple[bool, str]:
    from verlj.engine.post_mortem.diff import first_difference

    try:
        d = first_difference(run, ref, full=True)
    except Exception as e:  # noqa: BLE001 - reported as the trial's note
        return False, f"diff failed: {e}"
    if d.identical:
        return True, ""
    return False, f"first difference at step {d.step}: {', '.join(d.differs)}"


def resume_until_done(run: Path, *over, tries=8, each: Callable[[str], None] | None = None, **extra) -> subprocess.CompletedProcess | None:
    """`verlj train --resume` again while it is SIGKILLed (up to `tries` times): its last output, or None if it kept dying.
    `each` is given every resume's output (stdout and stderr)."""
    for _ in range(tries):
        out = train(run, *over, **extra)
        if each is not None:
            each(out.stdout + out.stderr)
        if out.returncode != -9:
            return out
    return None


# ----------------------------------------------------------------------------- kills


def resume_failure(out: subprocess.CompletedProcess | None) -> str:
    """Why resume_until_done did not end the run: its last resume's last line, or that it kept dying."""
    return "resume failed: " + ((out.stderr.strip().splitlines() or ["?"])[-1] if out else "kept dying")


def kill_at_random(run: Path, rng: random.Random, *over: str, group: bool = True, **extra) -> None:
    """SIGKILL `verlj train` at a random moment: its whole process group, or (group=False) the trainer alone."""
    cmd = [PYTHON[0], "-m", "verlj.cli", "train", "--output-dir", str(run), *SMALL, *over, "--resume"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env(**extra), cwd=REPO,
                         start_new_session=True)
    want = rng.randint(0, TARGET - 1)
    seen = 0
    deadline = time.time() + 120
    if want == 0:
        time.sleep(rng.uniform(0.5, 4.0))  # somewhere in start-up, loading or the first steps
    else:
        for line in p.stdout:
            if ": reward=" in line or "Resuming" in line or "Replayed" in line:
                seen += 1
            if seen >= want or time.time() > deadline:
                break
        time.sleep(rng.uniform(0.0, 0.12))
    try:
        if group:
            os.killpg(p.pid, signal.SIGKILL)
        else:
            p.kill()
    except ProcessLookupError:
        pass
    p.wait()


def kill_trial(root: Path, ref: Path, rng: random.Random, n: int) -> Trial:
    run = root / f"kill{n}"
    mode = rng.choice(["random", "failpoint", "failpoint", "replay"])
    if mode == "random":
        kills = rng.randint(1, 3)
        for _ in range(kills):
            kill_at_random(run, rng)
        what = f"{kills} random SIGKILL(s)"
    elif mode == "failpoint":
        point = rng.choice(sorted(FAILPOINTS))
        count = rng.randint(1, FAILPOINTS[point])
        out = train(run, VERLJ_FAILPOINT=f"{point}:{count}")
        what = f"SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")
    else:
        k = rng.choice([3, 5, 7])
        train(run, VERLJ_FAILPOINT=f"journal.after_commit:{k}")
        out = train(run, VERLJ_FAILPOINT="replay.step:1")
        what = f"SIGKILL after step {k}'s commit, then inside the resume's replay" + ("" if out.returncode == -9 else " (replay not reached)")
    out = resume_until_done(run)
    if out is None or out.returncode != 0:
        return Trial("kill", n, what, "NOT EXACT", resume_failure(out))
    same, note = identical(run, ref)
    shutil.rmtree(run, ignore_errors=True)
    return Trial("kill", n, what, "exact" if same else "NOT EXACT", note)


# ----------------------------------------------------------------------------- the memory mirror

MIRROR_POINTS = {"mirror.held": 6, "mirror.mid_write": 6}  # steps 1-3 and 5-7: a snapshot's step (4, 8) writes no mirror


def mirror_trial(root: Path, ref: Path, rng: random.Random, n: int, counts: Counter) -> Trial:
    """trainer.mirror_interval=1, killed at random moments or in a mirror's write, resumed until done: exact against
    the uninterrupted run (no mirror), whatever each resume loaded."""
    run = root / f"mirror{n}"
    # snapshots every 4 steps (the small settings' 2 would leave a mirror only the odd steps, a snapshot as new beside each)
    over = ["trainer.mirror_interval=1", f"trainer.mirror_dir={root / 'shm'}", "trainer.save_interval=4"]
    mode = rng.choice(["random", "random", "failpoint", "replay"])
    if mode == "random":
        kills = rng.randint(1, 3)
        for _ in range(kills):
            kill_at_random(run, rng, *over)
        what = f"{kills} random SIGKILL(s)"
    elif mode == "failpoint":
        point = rng.choice(sorted(MIRROR_POINTS))
        count = rng.randint(1, MIRROR_POINTS[point])
        out = train(run, *over, VERLJ_FAILPOINT=f"{point}:{count}")
        what = f"SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")
    else:
        k = rng.choice([2, 3, 6, 7])  # after the commit of step k, before its mirror: the resume replays step k
        train(run, *over, VERLJ_FAILPOINT=f"journal.after_commit:{k}")
        out = train(run, *over, VERLJ_FAILPOINT="replay.step:1")
        what = f"SIGKILL after step {k}'s commit, then in the resume's replay" + ("" if out.returncode == -9 else " (nothing to replay)")

    def loaded(text: str) -> None:  # what each resume started from
        counts["from_mirror"] += "(the memory mirror of step" in text
        counts["from_disk"] += "Resuming from checkpoint:" in text and "(the memory mirror of step" not in text
        counts["from_start"] += "replaying from the initial state" in text

    out = resume_until_done(run, *over, each=loaded)
    if out is None or out.returncode != 0:
        return Trial("mirror", n, what, "NOT EXACT", resume_failure(out))
    same, note = identical(run, ref)
    shutil.rmtree(run, ignore_errors=True)
    return Trial("mirror", n, what, "exact" if same else "NOT EXACT", note)


# ----------------------------------------------------------------------------- bit flips

FLIP_STEPS = 12
BITFLIP = [f"trainer.total_steps={FLIP_STEPS}", "trainer.save_interval=3", "trainer.save_total_limit=0", "algorithm.dynamic_sampling=false"]


def bitflip_trial(root: Path, refs: dict[int, Path], rng: random.Random, n: int, counts: Counter) -> Trial:
    """One bit flipped in one step of a clean run; `verlj rerun` over all its steps must name that
    step and stage and reproduce every other step it re-executes."""
    import verlj.engine  # noqa: F401  (declares verlj's event types to the journal)
    from verlj.journal import open_journal_reader

    zero, target = rng.choice([0, 1, 2, 3]), ("params", "grads")[n % 2]  # as many of each
    step, seed = rng.randint(1, FLIP_STEPS), rng.randrange(1 << 30)
    ref = refs.get(zero)
    if ref is None:
        ref = refs[zero] = root / f"ref_flip{zero}"
        assert train(ref, *BITFLIP, f"distributed.zero_stage={zero}", resume=False).returncode == 0
    with open_journal_reader(ref / "journal") as j:
        per_step = int(j.read_step(1).first("stages")["summary"]["grad_norm"]["n"])  # optimizer steps a step
        ref_fp = j.read_step(step).state_fingerprint
    if target == "grads":
        point, count, stage = "update.grads", (step - 1) * per_step + rng.randint(1, per_step), "grads"
    else:
        point, count, stage = "update.params", step, "state"
    run = root / f"flip{n}"
    out = train(run, *BITFLIP, f"distributed.zero_stage={zero}", resume=False, VERLJ_FAILPOINT=f"{point}:{count}:flip={seed}")
    what = f"ZeRO-{zero}: a bit of the {target} flipped at step {step}"
    if out.returncode != 0:
        return Trial("bitflip", n, what, "CRASH", out.stderr[-300:])
    with open_journal_reader(run / "journal") as j:
        effective = j.read_step(step).state_fingerprint != ref_fp
    out = verlj("rerun", run, "--steps", f"1:{FLIP_STEPS}", "--json")
    shutil.rmtree(run, ignore_errors=True)
    try:
        verdicts = json.loads(out.stdout)["verdicts"]
    except ValueError:
        return Trial("bitflip", n, what, "CRASH", f"rerun exited {out.returncode}: " + out.stderr[-300:])
    differs = [v for v in verdicts if v["verdict"] == "differs"]
    false = [v["step"] for v in differs if v["step"] != step]
    hit = [v for v in differs if v["step"] == step]
    counts.update(clean=sum(v["verdict"] == "reproduced" for v in verdicts) + len(false), false=len(false),
                  unchecked=sum(v["verdict"] == "not checked" for v in verdicts), changed_run=int(effective))
    note = "" if effective else "the flip left the step's state as the clean run's"
    if false:
        return Trial("bitflip", n, what, "FALSE ALARM", f"clean steps flagged: {false}")
    if not hit:
        return Trial("bitflip", n, what, "MISSED", note)
    if hit[0]["stage"] != stage:
        return Trial("bitflip", n, what, "WRONG STAGE", f"named {hit[0]['stage']}, not {stage}")
    return Trial("bitflip", n, what, "found", note)


# ----------------------------------------------------------------------------- async rollout

ASYNC = ["rollout.mode=async", "algorithm.max_sampling_rounds=2"]
ASYNC_POINTS = {"async.start": 1, "async.admit": TARGET, "async.push": TARGET - 1, "async.consume": TARGET, "step.before_commit": TARGET,
                "journal.before_commit": TARGET}


def async_kills(run: Path, over: list[str], rng: random.Random, label: str, slow: str = "", each=lambda: None) -> tuple[str, str | None]:
    """An async trial's kills: random SIGKILLs of the trainer (alone or with its generator), one at a
    failpoint, or the generator's alone (`slow`: a failpoint spec slowing the generator meanwhile;
    `each` runs after each kill). Returns what was done, and why the trial failed already, if it did."""
    slowed = {"VERLJ_FAILPOINT": slow} if slow else {}
    mode = rng.choice(["group", "trainer", "failpoint", "failpoint", "generator"])
    if mode in ("group", "trainer"):
        kills = rng.randint(1, 2)
        for _ in range(kills):
            kill_at_random(run, rng, *over, group=mode == "group", **slowed)
            each()
        return f"{label}: {kills} random SIGKILL(s) of the " + ("trainer and its generator" if mode == "group" else "trainer alone"), None
    if mode == "failpoint":
        point = rng.choice(sorted(ASYNC_POINTS))
        count = rng.randint(1, ASYNC_POINTS[point])
        out = train(run, *over, VERLJ_FAILPOINT=",".join(filter(None, [slow, f"{point}:{count}"])))
        each()
        return f"{label}: SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)"), None
    count = rng.randint(1, TARGET)
    out = train(run, *over, VERLJ_FAILPOINT=f"generator.before_reply:{count}")  # one entry a failpoint: not slowed here
    each()
    what = f"{label}: SIGKILL of the generator at its reply {count}" + ("" if out.returncode else " (not reached)")
    stopped = out.returncode == 1 and "the rollout generator process" in out.stderr and clean_error(out)
    return what, ("the run did not stop in one clear line: " + out.stderr[-300:]) if out.returncode and not stopped else None


def async_trial(root: Path, refs: dict[int, Path], rng: random.Random, n: int, counts: Counter) -> Trial:
    k = rng.choice(sorted(refs))
    over = [*ASYNC, f"rollout.max_staleness={k}"]
    run = root / f"async{n}"
    what, failed = async_kills(run, over, rng, f"k={k}")
    if failed:
        return Trial("async", n, what, "NOT EXACT", failed)
    out = resume_until_done(run, *over)
    if out is None or out.returncode != 0:
        return Trial("async", n, what, "NOT EXACT", resume_failure(out))
    same, note = identical(run, refs[k])
    lost, dup, skipped = sample_accounting(run, refs[k])
    counts.update(lost=lost, duplicated=dup, skipped=skipped)
    shutil.rmtree(run, ignore_errors=True)
    if lost or dup or skipped:
        same, note = False, f"{lost} completed samples lost, {dup} prompts trained more, {skipped} fewer than uninterrupted; " + note
    return Trial("async", n, what, "exact" if same else "NOT EXACT", note)


# completion order: the generator slowed (below the trainer) so that groups are queued at every commit
SLOW_GENERATOR = "generator.before_reply:1:sleep-each=0.3"


def completion_trial(root: Path, rng: random.Random, n: int, counts: Counter) -> Trial:
    """rollout.async_order=completion: timing decides what each step takes, so there is no
    uninterrupted run to equal. A committed step never changes; then `verify --deep` (every
    fingerprint replayed, every group accounted for), the prompts asked in the dataset's order, and
    the samples of the groups asked again generated by the version the resume held."""
    k = rng.choice([1, 4])
    over = [*ASYNC, f"rollout.max_staleness={k}", "rollout.async_order=completion"]
    run = root / f"completion{n}"
    kept: dict[int, str] = {}

    def keep() -> None:
        kept.update(_kept(run, kept))

    try:
        what, failed = async_kills(run, over, rng, f"completion k={k}", slow=SLOW_GENERATOR, each=keep)
    except AssertionError as e:  # a committed step changed
        return Trial("async", n, f"completion k={k}", "NOT EXACT", str(e))
    if failed:
        return Trial("async", n, what, "NOT EXACT", failed)
    out = resume_until_done(run, *over, VERLJ_FAILPOINT=SLOW_GENERATOR)
    if out is None or out.returncode != 0:
        return Trial("async", n, what, "NOT EXACT", resume_failure(out))
    problems = completion_problems(run, kept, counts)
    shutil.rmtree(run, ignore_errors=True)
    return Trial("async", n, what, "NOT EXACT" if problems else "exact", "; ".join(problems))


def _kept(run: Path, before: dict[int, str]) -> dict[int, str]:
    """The run's committed fingerprints, after checking that those committed `before` did not change."""
    if not (run / "journal" / "data.mdb").exists():
        return {}
    Journal, _ = _journal()
    with Journal.open_reader(run / "journal") as j:
        now = {r.step: r.state_fingerprint for r in j.iter_steps(payload=False)}
    changed = [s for s, fp in before.items() if now.get(s) != fp]
    if changed:
        raise AssertionError(f"committed steps {changed} changed")
    return now


def completion_problems(run: Path, kept: dict[int, str], counts: Counter, resumed: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """`resumed`: groups of episodes that went on from durable turns (their version is their first turn's)."""
    from verlj.engine.config import config_from_dict
    from verlj.engine.loop.ledger import open_run
    from verlj.engine.post_mortem.rollouts import group_accounting
    from verlj.engine.rl.data import Sampler, load_data

    problems = []
    try:
        _kept(run, kept)
    except AssertionError as e:
        problems.append(str(e))
    out = verlj("verify", run, "--deep")
    if out.returncode != 0 or "✓ Rollout accounting" not in out.stdout:
        problems.append("verify --deep: " + next((line.strip() for line in out.stdout.splitlines() if "✗" in line), out.stderr.strip()[-200:]))
    with open_run(run) as ledger:
        acc = group_accounting(ledger)
        cfg = config_from_dict(ledger.identity.all()["config"])
        records = list(ledger.journal.iter_steps())
    size = len(load_data(cfg.data, cfg.trainer.seed).train)
    want = Sampler(size, cfg.trainer.seed).draw(len(acc.rows)).tolist()
    skipped = sum(1 for a, b in zip(acc.rows, want) if a != b)
    duplicated = len(acc.fate_twice) + len(acc.arrived_twice)
    lost = len(acc.fate_unarrived) + len(acc.arrived_unasked)
    wrong_version = 0
    for r in records:
        again = r.first("buffer.request")["regenerated"]
        if len(again):
            cols = r.first("buffer.add")["samples"]
            mine = [q for q, g in enumerate(cols["group"].tolist()) if g in set(again.tolist()) and g not in resumed]
            wrong_version += sum(1 for q in mine if int(cols["policy_version"][q]) != r.step - 1)
        if r.metrics.get("rollout/logprob_diff/max", 0.0) >= 1e-5:  # absent: no update (every group dropped)
            problems.append(f"step {r.step}: samples of version {r.step - 1} are not that version's (log-prob gap {r.metrics['rollout/logprob_diff/max']:.2g})")
    counts.update(lost=lost, duplicated=duplicated, skipped=skipped, regenerated=acc.regenerated, wrong_version=wrong_version,
                  completion=1)
    if lost or duplicated or skipped or wrong_version:
        problems.append(f"{lost} completed samples lost, {duplicated} trained or arrived twice, {skipped} prompts out of the dataset's "
                        f"order, {wrong_version} samples asked again not generated by the version resumed with")
    return problems


# ----------------------------------------------------------------------------- episodes

EPISODES = ["rollout.env=builtin:guess", "rollout.max_turns=3", "model.tiny.vocab=ascii", "rollout.max_response_length=3"]
EPISODE_POINTS = {"episodes.before_durable": 12, "episodes.after_durable": 12}


def killed_then_resumed(run: Path, over: list[str], rng: random.Random, label: str, points: dict[str, int], slow: str,
                        keep: Callable[[], None]) -> tuple[str, str | None]:
    """A completion-order trial's kill and resume (the episodes and partial kinds): a SIGKILL at one of `points` (at a
    random count up to its bound) or async_kills' random ones, with `slow` (a failpoint spec) slowing the generator
    and `keep` run after each kill; then --resume until done. What was done, and why the trial failed (None: the run
    ended)."""
    try:
        if rng.random() < 0.5:
            point = rng.choice(sorted(points))
            count = rng.randint(1, points[point])
            out = train(run, *over, VERLJ_FAILPOINT=f"{slow},{point}:{count}")
            keep()
            what = f"{label}: SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")
        else:
            what, failed = async_kills(run, over, rng, label, slow=slow, each=keep)
            if failed:
                return what, failed
    except AssertionError as e:  # a committed step changed
        return label, str(e)
    out = resume_until_done(run, *over, VERLJ_FAILPOINT=slow)
    return what, None if out is not None and out.returncode == 0 else resume_failure(out)


def episodes_trial(root: Path, refs: dict[tuple[str, str], Path], rng: random.Random, n: int, counts: Counter) -> Trial:
    order, algo = rng.choice(["sync", "step", "completion", "completion"]), rng.choice(["grpo", "ppo"])
    over = [*EPISODES, f"algorithm.name={algo}"] + ([] if order == "sync" else [*ASYNC, f"rollout.async_order={order}"])
    run, label = root / f"episodes{n}", f"{order} {algo}"
    if order != "completion":
        ref = refs.get((order, algo))
        if ref is None:
            ref = refs[(order, algo)] = root / f"ref_episodes_{order}_{algo}"
            assert train(ref, *over, resume=False).returncode == 0, "episodes reference run failed"
        what, failed = async_kills(run, over, rng, label) if order == "step" else (f"{label}: " + kill_trial_kills(run, rng, over), None)
        if failed:
            return Trial("episodes", n, what, "NOT EXACT", failed)
        out = resume_until_done(run, *over)
        if out is None or out.returncode != 0:
            return Trial("episodes", n, what, "NOT EXACT", resume_failure(out))
        same, note = identical(run, ref)
        shutil.rmtree(run, ignore_errors=True)
        return Trial("episodes", n, what, "exact" if same else "NOT EXACT", note)
    kept: dict[int, str] = {}
    durable: dict = {}  # group -> its durable state at the last kill, as a resume takes it (turns of committed versions)

    def keep() -> None:
        kept.update(_kept(run, kept))
        durable.update(_durable(run))

    what, failed = killed_then_resumed(run, over, rng, label, EPISODE_POINTS, SLOW_GENERATOR, keep)
    if failed is not None:
        return Trial("episodes", n, what, "NOT EXACT", failed)
    problems = completion_problems(run, kept, counts, resumed=set(durable))
    problems += episode_problems(run, durable, counts)
    shutil.rmtree(run, ignore_errors=True)
    return Trial("episodes", n, what, "NOT EXACT" if problems else "exact", "; ".join(problems))


# ----------------------------------------------------------------------------- effects (rollout.tools)

TESTS = REPO / "tests"  # agents_for_tests, tools_for_tests: the agent and the services outside the episode
EFFECTS = ["model.tiny.vocab=ascii", "rollout.agent=agents_for_tests:ticketing", "rollout.max_turns=2",
           "rollout.tools=[tools_for_tests:open_ticket,tools_for_tests:post_message]", "rollout.max_fault_rate=1"]
EFFECT_POINTS = {"tools.after_sent": 8 * TARGET, "tools.after_run": 8 * TARGET, "tools.after_done": 8 * TARGET}


def effects_trial(root: Path, refs: dict[str, Path], rng: random.Random, n: int, counts: Counter) -> Trial:
    order, tool = rng.choice(["sync", "step", "completion"]), rng.choice(["open_ticket", "post_message"])
    over = EFFECTS + ([] if order == "sync" else [*ASYNC, f"rollout.async_order={order}"])
    run, label = root / f"effects{n}", f"{order} {tool}"
    effects = root / f"effects{n}.jsonl"
    extra = {"PYTHONPATH": str(TESTS), "VERLJ_TEST_TOOL": tool, "VERLJ_TEST_EFFECTS": str(effects)}
    kept: dict[int, str] = {}
    try:
        if rng.random() < 0.5:
            point = rng.choice(sorted(EFFECT_POINTS))
            count = rng.randint(1, EFFECT_POINTS[point])
            out = train(run, *over, VERLJ_FAILPOINT=f"{point}:{count}", **extra)
            what = f"{label}: SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")
        else:
            kills = rng.randint(1, 2)
            for _ in range(kills):
                kill_at_random(run, rng, *over, **extra)
                kept = _kept(run, kept)
            what = f"{label}: {kills} random SIGKILL(s)"
        kept = _kept(run, kept)
        out = resume_until_done(run, *over, **extra)
        kept = _kept(run, kept)
    except AssertionError as e:  # a committed step changed
        return Trial("effects", n, label, "NOT EXACT", str(e))
    if out is None or out.returncode != 0:
        return Trial("effects", n, what, "NOT EXACT", resume_failure(out))
    problems = effect_problems(run, effects, tool, counts)
    if order != "completion" and tool == "open_ticket" and not problems:  # bit-identical: every step's state, as uninterrupted
        ref = refs.get(order)
        if ref is None:
            ref = refs[order] = root / f"ref_effects_{order}"
            ref_extra = {**extra, "VERLJ_TEST_EFFECTS": str(root / f"ref_effects_{order}.jsonl")}
            assert train(ref, *over, resume=False, **ref_extra).returncode == 0, "effects reference run failed"
        mine, theirs = _kept(run, {}), _kept(ref, {})
        if mine != theirs:
            step = min(s for s in theirs if mine.get(s) != theirs[s])
            problems.append(f"step {step}'s fingerprint differs from the uninterrupted run's ({faulted(run, step)} faulted samples in it, "
                            f"{faulted(ref, step)} in the uninterrupted run's; kept in {run})")
    if not problems:
        shutil.rmtree(run, ignore_errors=True)
    duplicated = any(p.startswith("applied twice") for p in problems)
    return Trial("effects", n, what, "DUPLICATED" if duplicated else "NOT EXACT" if problems else "exact", "; ".join(problems))


def faulted(run: Path, step: int) -> int:
    """How many of a step's samples ended by a fault (an agent's timeout on a loaded machine, say; unresolved ones aside)."""
    Journal, _ = _journal()
    from verlj.engine.schema.events import StepEvents
    from verlj.engine.schema.sample import EnvEnd, unpack

    with Journal.open_reader(run / "journal") as j:
        rec = next(r for r in j.iter_steps() if r.step == step)
    return sum(bool(s.fault_reason) and s.env_end != EnvEnd.UNRESOLVED for s in unpack(StepEvents.of(rec).added.samples))


def effect_problems(run: Path, effects: Path, tool: str, counts: Counter) -> list[str]:
    """What the outside world and the journal say of a run's tool calls (effect_trial's checks)."""
    Journal, _ = _journal()
    from verlj.engine.schema.events import DropReason, StepEvents
    from verlj.engine.schema.sample import EnvEnd, unpack

    seen = []
    for line in effects.read_text().splitlines() if effects.exists() else []:
        try:
            seen.append(json.loads(line))
        except ValueError:  # a line a kill tore mid-write (the services run in the trainer's process): never applied
            counts["torn"] += 1
    faults = sum(faulted(run, s) for s in _kept(run, {}))
    problems_faults = [f"{faults} samples faulted"] if faults else []
    applied = Counter(e["key"] for e in seen if e["kind"] == "applied")
    problems = [f"applied twice: {k}" for k, v in applied.items() if v > 1] + problems_faults
    if any(e["kind"] == "dedup" for e in seen):
        problems.append(f"{sum(e['kind'] == 'dedup' for e in seen)} keys sent again (the service's own keys caught them)")
    with Journal.open_reader(run / "journal") as j:
        steps = [StepEvents.of(r) for r in j.iter_steps()]
    samples = [s for st in steps for s in unpack(st.added.samples)]
    unresolved = {int(s.id) for s in samples if s.env_end == EnvEnd.UNRESOLVED}
    consumed = {int(i) for st in steps if st.consumed is not None for i in st.consumed.ids.tolist()}
    dropped = {int(i) for st in steps for i in st.dropped(DropReason.FAULT)}
    if unresolved & consumed or not unresolved <= dropped:
        problems.append(f"unresolved episodes trained: {sorted(unresolved & consumed or unresolved - dropped)}")
    if tool == "open_ticket" and unresolved:
        problems.append(f"{len(unresolved)} episodes unresolved though the tool reconciles")
    metric = sum(st.metrics.values.get("agent/unresolved", 0.0) for st in steps)
    if metric < len(unresolved):
        problems.append(f"agent/unresolved counts {metric:g} of {len(unresolved)} unresolved episodes")
    counts["trials"] += 1
    counts["unresolved"] += len(unresolved)
    counts["from_journal"] += int(sum(st.metrics.values.get("agent/tool_calls_from_journal", 0.0) for st in steps))
    counts["reconciled"] += int(sum(st.metrics.values.get("agent/tool_calls_reconciled", 0.0) for st in steps))
    counts["effects"] += sum(applied.values())
    return problems


# ----------------------------------------------------------------------------- partial rollouts

PARTIAL = [*ASYNC, "rollout.async_order=completion", "rollout.partial=true", "rollout.max_staleness=2", "rollout.max_response_length=24"]
SLOW_TOKENS = "generator.token:1:sleep-each=0.01"  # a push (every step) finds generations going
PARTIAL_POINTS = {"partial.before_durable": TARGET, "partial.after_durable": TARGET}


def partial_trial(root: Path, rng: random.Random, n: int, counts: Counter) -> Trial:
    """rollout.partial: the completion kind's checks, and every generation durable at a kill went on from its tokens."""
    run = root / f"partial{n}"
    kept: dict[int, str] = {}
    phases: list[tuple[int, dict]] = []  # at each kill: the last committed step, and the generations durable (what the resume reads)

    def keep() -> None:
        kept.update(_kept(run, kept))
        phases.append((max(kept, default=0), _stopped(run)))

    what, failed = killed_then_resumed(run, PARTIAL, rng, "partial", PARTIAL_POINTS, SLOW_TOKENS, keep)
    if failed is not None:
        return Trial("partial", n, what, "NOT EXACT", failed)
    problems, continued = partial_problems(run, phases, counts)
    problems = completion_problems(run, kept, counts, resumed=continued) + problems
    shutil.rmtree(run, ignore_errors=True)
    return Trial("partial", n, what, "NOT EXACT" if problems else "exact", "; ".join(problems))


def _stopped(run: Path) -> dict:
    """The generations durable in the run's journal (rollout.partial), each cut as a resume takes it."""
    from verlj.engine.loop.ledger import Ledger

    if not (run / "journal" / "data.mdb").exists():
        return {}
    with Ledger.open_reader(run) as ledger:
        last = ledger.last_step()
        return {g: state.through(last) for g, state in ledger.in_flight.partial_groups().items()}


def partial_problems(run: Path, phases: list[tuple[int, dict]], counts: Counter) -> tuple[list[str], set[int]]:
    """Each resume (after its last committed step, with the generations it read durable): every group it asked
    that had durable tokens for the same prompt went on from them, none from its start, and that group's
    trained samples begin with them (ids, log-probs bit for bit, versions). Returns the problems and the groups continued."""
    import numpy as np

    from verlj.engine.schema.events import StepEvents
    from verlj.engine.schema.sample import Columns, token_versions

    Journal, _ = _journal()
    with Journal.open_reader(run / "journal") as j:
        steps = {r.step: StepEvents.of(r) for r in j.iter_steps()}
    samples: dict[int, list] = {}
    for ev in steps.values():
        for smp in Columns(ev.added.samples).samples() if ev.added is not None and ev.added.samples is not None else []:
            samples.setdefault(smp.group, []).append(smp)
    problems, history = [], {}
    for step, ev in steps.items():
        if ev.requests is None:
            continue
        read = [d for after, d in phases if after < step][-1:] or [{}]
        asked = {int(g): int(r) for g, r in zip(ev.requests.groups, ev.requests.rows)}
        again = {int(g) for g in ev.requests.regenerated} | {g for g, r in asked.items() if g in read[0] and read[0][g].row == r}
        want = {g for g in again if g in read[0] and read[0][g].tokens}
        got = {int(g) for g in ev.requests.continued}
        if want != got:
            problems.append(f"step {step}: groups {sorted(want - got)} asked again from their start, {sorted(got - want)} "
                            "went on from tokens not durable")
        for g in got & want:
            history.setdefault(g, []).append(read[0][g])
    for g, states in history.items():
        for j, smp in enumerate(sorted(samples.get(g, []), key=lambda x: x.id)):
            for state in states:
                k = len(state.responses[j])
                if not (np.array_equal(smp.response_ids[:k], state.responses[j]) and smp.gen_logprobs[:k].tobytes() == state.logprobs[j].tobytes()
                        and np.array_equal(smp.token_versions()[:k], token_versions(state.runs[j]))):
                    problems.append(f"group {g}: sample {smp.id} does not begin with its durable tokens")
        counts.update(durable_tokens=sum(state.tokens for state in states[-1:]))
    counts.update(partial=1, continued=len(history))
    return problems, set(history)


def kill_trial_kills(run: Path, rng: random.Random, over: list[str]) -> str:
    """Sync mode's kills: random SIGKILLs, or one at a failpoint."""
    if rng.random() < 0.5:
        kills = rng.randint(1, 2)
        for _ in range(kills):
            kill_at_random(run, rng, *over)
        return f"{kills} random SIGKILL(s)"
    point = rng.choice(sorted(FAILPOINTS))
    count = rng.randint(1, FAILPOINTS[point])
    out = train(run, *over, VERLJ_FAILPOINT=f"{point}:{count}")
    return f"SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")


def _durable(run: Path) -> dict:
    """The groups of episodes durable in the run's journal, each cut as a resume takes it."""
    from verlj.engine.loop.ledger import Ledger

    if not (run / "journal" / "data.mdb").exists():
        return {}
    with Ledger.open_reader(run) as ledger:
        last = ledger.last_step()
        out = {}
        for g, state in ledger.in_flight.groups().items():
            cut = state.before(sum(v <= last for v in state.versions))
            if cut is not None:
                out[g] = cut
        return out


def episode_problems(run: Path, durable: dict, counts: Counter) -> list[str]:
    """Every trained episode whose group was durable at a kill begins with its durable turns."""
    import numpy as np

    Journal, _ = _journal()
    from verlj.engine.schema.events import StepEvents
    from verlj.engine.schema.sample import unpack

    seeds = {seed: (g, k) for g, state in durable.items() for k, seed in enumerate(state.env_seed)}
    bad = resumed = 0
    with Journal.open_reader(run / "journal") as j:
        for rec in j.iter_steps():
            added = StepEvents.of(rec).added
            for s in unpack(added.samples) if added is not None and added.samples is not None else []:
                if int(s.env_seed) not in seeds:
                    continue
                g, k = seeds[int(s.env_seed)]
                state = durable[g]
                m = len(state.response_ids[k])
                if not (np.array_equal(s.response_ids[:m], state.response_ids[k]) and np.array_equal(s.turn_lens[: len(state.turn_lens[k])], state.turn_lens[k])):
                    bad += 1
                resumed += len(state.turn_lens[k]) // 2
    counts.update(durable_turns=resumed, episodes=1)
    return [f"{bad} episodes did not go on from their durable turns"] if bad else []


def sample_accounting(run: Path, ref: Path) -> tuple[int, int, int]:
    """Against the uninterrupted run: completed samples (journaled, by id and content) it lacks, and
    dataset rows trained more or fewer times."""
    Journal, _ = _journal()

    def read(path: Path):
        samples, trained = {}, Counter()
        with Journal.open_reader(path / "journal") as j:
            for r in j.iter_steps():
                cols = r.first("buffer.add")["samples"]
                for q, sid in enumerate(cols["id"].tolist()):
                    samples[sid] = (int(cols["index"][q]), cols["response_ids"][q].tobytes(), int(cols["policy_version"][q]))
                for sid in r.first("buffer.consume")["ids"].tolist():
                    trained[samples[sid][0]] += 1
        return samples, trained

    (a, ta), (b, tb) = read(run), read(ref)
    lost = sum(1 for sid, v in b.items() if a.get(sid) != v)
    return lost, sum((ta - tb).values()), sum((tb - ta).values())


# ----------------------------------------------------------------------------- rollout fleet on Ray

FLEET = [*ASYNC, "rollout.fleet=ray", "rollout.fleet_size=2", "trainer.max_restarts=3"]
NOT_FLEET = ("timing_s/", "rollout/fleet/")  # the fleet's own counters (deaths, live actors) differ by design from the reference's
FLEET_DISPATCHES = 12  # fleet.dispatch:N:kill-actor, N drawn from 1..this (about the calls a run hands out)


class RayCluster:
    """One local Ray cluster for the campaign (as tests/integration/conftest.py's `cluster`): started by this
    process, joined by every `verlj train` through RAY_ADDRESS, stopped on exit (Ctrl-C included)."""

    def __enter__(self) -> RayCluster:
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 object_store_memory=256 * 1024 * 1024)
        self.address = ray.get_runtime_context().gcs_address
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()

    @staticmethod
    def actors() -> list[int]:
        """The pids of this cluster's generator actors: processes titled ray::GeneratorActor whose parent (the
        raylet) is a child of this process (other clusters on the machine are left alone)."""
        procs: dict[int, tuple[int, str]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    procs[int(d)] = (ppid, Path(f"/proc/{d}/cmdline").read_text())
                except (OSError, IndexError, ValueError):
                    pass
        mine = {pid for pid, (ppid, _) in procs.items() if ppid == os.getpid()}
        return sorted(pid for pid, (ppid, cmd) in procs.items() if ppid in mine and cmd.startswith("ray::GeneratorActor"))


def fleet_deaths(run: Path) -> int:
    """The actor deaths the fleet counted in the journal's metrics (rollout/fleet/deaths counts since its trainer
    process started: a step with a start or resume event begins a new count)."""
    if not (run / "journal" / "data.mdb").exists():
        return 0
    Journal, _ = _journal()
    total = last = 0
    with Journal.open_reader(run / "journal") as j:
        for rec in j.iter_steps(payload=False):
            if any(e["type"] == "control" and e.get("kind") in ("start", "resume") for e in rec.events):
                last = 0
            d = int(rec.first("metrics")["values"].get("rollout/fleet/deaths", 0))
            total, last = total + max(0, d - last), d
    return total


def same_journal(run: Path, ref: Path, ignore: tuple[str, ...]) -> tuple[bool, str]:
    """Every step's events (the fingerprint among them) alike, bit for bit, but control and config events and
    the metrics `ignore` names (tests/verlj_testing.assert_same_journal, for a tool)."""
    import numpy as np

    def same(a, b) -> bool:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) and a != a:
            return isinstance(b, float) and b != b
        return type(a) is type(b) and a == b

    def steps(path: Path) -> list[tuple[int, list[dict]]]:
        out = []
        Journal, _ = _journal()
        with Journal.open_reader(path / "journal") as j:
            for rec in j.iter_steps():
                events = []
                for e in rec.events:
                    if e["type"] in ("control", "config"):
                        continue  # start / resume differ by design between a resumed and a straight run
                    if e["type"] == "metrics":
                        e = {**e, "values": {k: v for k, v in e["values"].items() if not k.startswith(ignore)}}
                    events.append(e)
                out.append((rec.step, events))
        return out

    a, b = steps(run), steps(ref)
    if [s for s, _ in a] != [s for s, _ in b]:
        return False, f"steps {[s for s, _ in a]}, the reference's {[s for s, _ in b]}"
    for (step, ea), (_, eb) in zip(a, b):
        if [e["type"] for e in ea] != [e["type"] for e in eb]:
            return False, f"step {step}: events {[e['type'] for e in ea]}, the reference's {[e['type'] for e in eb]}"
        for x, y in zip(ea, eb):
            if not same(x, y):
                return False, f"first difference at step {step}: {x['type']}"
    return True, ""


def fleet_trial(root: Path, ref: Path, cluster: RayCluster, rng: random.Random, n: int, counts: Counter) -> Trial:
    """A supervised run (trainer.max_restarts) on two generator actors: SIGKILL of one actor's process (at a
    random moment, or at a failpoint of the fleet's dispatch), of the trainer process (the supervisor's child)
    at a random moment, or both (an actor, then the trainer); the run must finish by itself. Step order: the
    journal equal to the uninterrupted run's; completion order: every group accounted for (completion_problems)."""
    completion = n % 2 == 0
    order = "completion" if completion else "step"
    over = [*FLEET, f"rollout.async_order={order}"]
    run = root / f"fleet{n}"
    mode = rng.choice(["actor", "actor", "trainer", "both", "both"])
    by_failpoint = mode == "actor" and rng.random() < 0.25
    extra = {"RAY_ADDRESS": cluster.address}
    what = f"{order} order: "
    if by_failpoint:
        k = rng.randint(1, FLEET_DISPATCHES)
        extra["VERLJ_FAILPOINT"] = f"fleet.dispatch:{k}:kill-actor"
        what += f"SIGKILL of an actor at the fleet's dispatch {k}"
    cmd = [PYTHON[0], "-m", "verlj.cli", "train", "--output-dir", str(run), *SMALL, *over]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(**extra), cwd=REPO,
                         start_new_session=True)
    assert p.stdout is not None
    lines: list[str] = []
    trainer, steps = None, 0
    # the kills: (step lines seen, delay after it) for the actor, then for the trainer
    plan: list[tuple[str, int, float]] = []
    if mode in ("actor", "both") and not by_failpoint:
        a = rng.randint(0, TARGET - 2 if mode == "both" else TARGET - 1)
        plan.append(("actor", a, rng.uniform(0, 3.0) if a == 0 else rng.uniform(0, 0.3)))
    if mode in ("trainer", "both"):
        t = rng.randint(plan[0][1] if plan else 0, TARGET - 1)
        plan.append(("trainer", t, rng.uniform(0, 15.0) if t == 0 else rng.uniform(0, 0.3)))
    done: list[str] = []
    started = False
    deadline = time.time() + 600
    for line in p.stdout:
        lines.append(line)
        if m := re.search(r"verlj: training in process (\d+)", line):
            trainer = int(m.group(1))
        started = started or "Starting training" in line
        if ": reward=" in line:
            steps += 1
        while plan and started and steps >= plan[0][1] and time.time() < deadline:
            who, at, delay = plan.pop(0)
            time.sleep(delay)
            if who == "actor":
                pids = cluster.actors()
                while not pids and time.time() < deadline:  # before the fleet's actors are up
                    time.sleep(0.1)
                    pids = cluster.actors()
                    if p.poll() is not None:
                        break
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                done.append(f"an actor after {at} step(s) +{delay:.2f} s")
            else:
                if trainer is not None:
                    try:
                        os.kill(trainer, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                done.append(f"the trainer after {at} step(s) +{delay:.2f} s")
        if not plan and not by_failpoint:
            break
    try:
        rest, _ = p.communicate(timeout=max(60, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rest, _ = p.communicate()
    lines.append(rest or "")
    text = "".join(lines)
    if done:
        what += "SIGKILL of " + ", then ".join(done)
    restarts = text.count("restarting it with --resume")
    deaths = fleet_deaths(run)
    counts.update(restarts=restarts, deaths=deaths, trials=1)
    what += f" ({deaths} actor death(s) counted, {restarts} trainer restart(s))"
    if p.returncode != 0 or f"Done: last committed step {TARGET}" not in text:
        tail = [x for x in text.strip().splitlines() if x.strip()][-3:]
        return Trial("fleet", n, what, "DID NOT FINISH", f"exit {p.returncode}: " + " | ".join(tail)[-300:])
    if completion:
        problems = completion_problems(run, {}, counts)
        outcome, note = ("NOT ACCOUNTED", "; ".join(problems)) if problems else ("accounted", "")
    else:
        same, note = same_journal(run, ref, NOT_FLEET)
        outcome = "exact" if same else "NOT EXACT"
    if outcome in GOOD:
        shutil.rmtree(run, ignore_errors=True)
    return Trial("fleet", n, what, outcome, note)


# ----------------------------------------------------------------------------- node loss


def node_loss_trial(root: Path, ref: Path, rng: random.Random, n: int) -> Trial:
    from verlj.journal import Journal, open_journal_reader, segments

    run, local = root / f"node{n}", root / f"node{n}-local"
    lag = rng.choice([0, 1, 2, 4])
    retain = rng.random() < 0.5
    fanout = rng.choice([2, 2, 64])  # 2: segments compacted all the time; 64 (the default): never in so short a run
    over = [f"journal.local_dir={local}", f"journal.ship_max_lag_steps={lag}", "trainer.save_total_limit=1",
            f"journal.segment_fanout={fanout}",
            *(["journal.retain_samples=since_oldest_snapshot", "journal.archive=true"] if retain else [])]
    what = f"lag {lag}, retention {'on' if retain else 'off'}, segment fanout {fanout}: "
    mode = rng.random()
    if mode < 0.3:
        kill_at_random(run, rng, *over)
        what += "SIGKILL at a random moment"
    elif mode < 0.45:
        k = rng.randint(2, 2 * TARGET)
        out = train(run, *over, VERLJ_FAILPOINT=f"ship.before_publish:{k}")
        what += f"SIGKILL mid shipment {k}" + ("" if out.returncode == -9 else " (not reached)")
    else:
        points = {**NODE_LOSS_POINTS, **(RETENTION_POINTS if retain else {}),
                  **(COMPACTION_POINTS if fanout == 2 else {}), **({"compact.rewrite": 2} if fanout == 2 and retain else {})}
        point = rng.choice(sorted(points))
        count = rng.randint(1, points[point])
        out = train(run, *over, VERLJ_FAILPOINT=f"{SLOW_SHIPPING},{point}:{count}")
        what += f"shipping slowed, SIGKILL at {point}:{count}" + ("" if out.returncode == -9 else " (not reached)")
    committed = 0
    if (local / "data.mdb").exists():
        with Journal.open_reader(local) as j:
            committed = j.last_step()
    found = segments.scan(run / "journal")
    shipped = found.last_step or 0
    files = sorted(segments.segment_dir(run / "journal").glob("*.seg")) if found.segments else []
    torn = False
    if files and rng.random() < 0.3:
        torn = True
        raw = bytearray(files[-1].read_bytes())
        if rng.random() < 0.5:
            files[-1].write_bytes(bytes(raw[: rng.randint(0, len(raw) - 1)]))
            what += ", last segment truncated"
        else:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            files[-1].write_bytes(bytes(raw))
            what += ", a bit flipped in the last segment"
    shutil.rmtree(local, ignore_errors=True)
    what += f"; node lost with {committed - shipped} unshipped step(s)"
    if committed - shipped > lag + 1:
        return Trial("node-loss", n, what, "BOUND EXCEEDED", f"committed {committed}, shipped {shipped}, bound {lag} + 1")
    if found.segments:
        with open_journal_reader(run / "journal") as j:  # what a recovery reads now: the segments alone
            shipped_now, named = j.last_step(), [info["path"] for info in j.meta.snapshots().values()]
        gone = [name for name in named if not (run / name).is_dir()]
        if gone and not torn:
            return Trial("node-loss", n, what, "SNAPSHOT LOST", f"the shipped journal names {', '.join(gone)}, deleted")
    else:
        shipped_now = 0
    # every snapshot of a step before the one being committed was published; the newest whose step the
    # segments hold (or a newer one) is where the resume must start
    floor = max((s for s in range(2, committed, 2) if s <= shipped_now), default=0)
    out = resume_until_done(run, *over[1:], f"journal.local_dir={root / f'node{n}-local2'}")
    if out is None or out.returncode != 0:
        return Trial("node-loss", n, what, "NOT EXACT", resume_failure(out))
    start = next((int(line.rsplit("step_", 1)[1]) for line in out.stdout.splitlines() if "Resuming from checkpoint:" in line), 0)
    if start < floor:
        return Trial("node-loss", n, what, "SNAPSHOT LOST", f"resumed from step {start}, step_{floor:05d} was valid and shipped")
    same, note = identical(run, ref)
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(root / f"node{n}-local2", ignore_errors=True)
    return Trial("node-loss", n, what, "exact" if same else "NOT EXACT", note)


# ----------------------------------------------------------------------------- corruption


def corrupt(run: Path, rng: random.Random) -> str:
    files = [p for p in sorted(run.rglob("step_*/**/*")) if p.is_file()]
    # the journal is one file among dozens: aim a third of the trials at it
    target = run / "journal" / "data.mdb" if rng.random() < 1 / 3 else rng.choice(files)
    rel = target.relative_to(run)
    data = bytearray(target.read_bytes())
    action = rng.choice(["flip", "flip", "flip", "truncate", "delete"])
    if action == "flip":
        k = rng.randint(1, 3)
        for _ in range(k):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        return f"{k} byte flip(s) in {rel}"
    if action == "truncate":
        cut = rng.randrange(len(data))
        target.write_bytes(bytes(data[:cut]))
        return f"{rel} truncated to {cut} of {len(data)} bytes"
    target.unlink()
    return f"{rel} deleted"


def corruption_trial(root: Path, finished: Path, ref10: Path, rng: random.Random, n: int) -> Trial:
    run = root / f"corrupt{n}"
    shutil.copytree(finished, run, symlinks=True)
    what = corrupt(run, rng)
    v = verlj("verify", run)
    if v.returncode < 0 or "Traceback" in v.stdout + v.stderr:
        return Trial("corruption", n, what, "CRASH", f"verify exited {v.returncode}")
    detected = v.returncode != 0
    out = train(run, "trainer.total_steps=10")
    if out.returncode < 0 or "Traceback" in out.stdout + out.stderr:
        return Trial("corruption", n, what, "CRASH", f"resume exited {out.returncode}")
    if out.returncode != 0:
        outcome = "refused clearly" if clean_error(out) and detected else ("SILENT" if not detected else "CRASH")
        note = (out.stderr.strip().splitlines() or ["?"])[-1][:140]
    else:
        same, note = identical(run, ref10)
        if same:
            outcome = "recovered exactly" if detected else "unaffected"
        else:
            outcome = "SILENT"
    if not detected and outcome == "unaffected":
        note = "damage fell in unused bytes (verify valid, resume exact)"
    shutil.rmtree(run, ignore_errors=True)
    return Trial("corruption", n, what, outcome, note)


# ----------------------------------------------------------------------------- disk full


def disk_full_trial(root: Path, ref: Path, n: int, size_kb: int) -> Trial:
    mnt = root / f"tmpfs{n}"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)], capture_output=True).returncode:
        return Trial("disk-full", n, "tmpfs mount", "skipped", "mount not permitted here")
    try:
        run = mnt / "run"
        first = train(run, resume=False)
        snaps_failed = first.stderr.count("Snapshot at step")
        what = f"{size_kb} KiB tmpfs"
        if first.returncode == 0:
            return Trial("disk-full", n, what, "NOT EXACT", "the run never ran out of space: make the tmpfs smaller"
                         if not snaps_failed else f"exit 0 although {snaps_failed} snapshot(s) failed")
        if first.returncode == 3:  # ran to its end, snapshots failed: said in the summary, so a scheduler sees it
            said = "Snapshots failed: " in first.stdout and "no space left on the run directory's disk" in first.stderr
            same, note = identical(run, ref)
            return Trial("disk-full", n, f"{what}: {snaps_failed} snapshot(s) hit ENOSPC, training went on, exit 3",
                         "kept going without snapshots" if same and said else "NOT EXACT", note if said else "the summary does not say why")
        if not (clean_error(first) and "no space left" in first.stderr.lower()):
            return Trial("disk-full", n, what, "NOT EXACT", "unclear stop: " + first.stderr.strip()[-200:])
        Journal, verify_journal = _journal()
        with Journal.open_reader(run / "journal") as j:
            committed_ok = verify_journal(j).ok
        subprocess.run(["mount", "-o", "remount,size=512m", str(mnt)], check=True)  # free space
        out = resume_until_done(run)
        if not committed_ok or out is None or out.returncode != 0:
            return Trial("disk-full", n, what, "NOT EXACT", "journal damaged or resume after freeing space failed")
        same, note = identical(run, ref)
        return Trial("disk-full", n, f"{what}: a journal commit hit ENOSPC" + (f" ({snaps_failed} snapshot(s) before)" if snaps_failed else ""),
                     "stopped clearly, resumed exactly" if same else "NOT EXACT", note)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ----------------------------------------------------------------------------- an operator's hands

OPERATOR_ACTIONS = ("copy", "move", "rm-snapshot", "rm-snapshots", "lose-journal", "lose-metadata")


def _snapshots_on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("step_*") if p.is_dir())


def operator_trial(root: Path, ref: Path, rng: random.Random, n: int) -> Trial:
    """What an operator does by hand to a run directory, at a random moment (after a SIGKILL at a random
    point, or between runs), then --resume (and verify). Passes when the resumed run is exact (or the
    resume is refused in one line where the run cannot go on: its journal lost), the original of a copy
    is untouched and still resumes exactly, and no snapshot that was valid is lost (quarantined, or
    deleted other than by save_total_limit's rotation after newer ones)."""
    run, local = root / f"op{n}", root / f"op{n}-local"
    shipped = rng.random() < 0.5
    over = [f"journal.local_dir={local}"] if shipped else []
    action = rng.choice(OPERATOR_ACTIONS)
    what = f"{'journal.local_dir' if shipped else 'journal in the run'}: "
    if action == "lose-journal" or rng.random() < 0.4:
        k = rng.randint(2, TARGET - 1)
        train(run, *over, f"trainer.total_steps={k}", resume=False)
        what += f"stopped at step {k}, "
    else:
        kill_at_random(run, rng, *over)
        what += "SIGKILL at a random moment, "
    snaps = _snapshots_on_disk(run)
    target = run
    if action == "copy":
        target = root / f"op{n}-copy"
        shutil.copytree(run, target, symlinks=True)
        what += "cp -a of the run resumed"
    elif action == "move":
        target = root / f"op{n}-moved"
        os.replace(run, target)
        what += "mv of the run resumed"
    elif action in ("rm-snapshot", "rm-snapshots") and snaps:
        gone = rng.sample(snaps, min(len(snaps), 1 if action == "rm-snapshot" else 2))
        for name in gone:
            shutil.rmtree(run / name)
        what += f"rm -rf {', '.join(gone)}"
    elif action == "lose-journal":
        shutil.rmtree(run / "journal")
        what += "journal/ lost"
    elif action == "lose-metadata":
        (run / "train_metadata.json").unlink(missing_ok=True)
        what += "train_metadata.json lost"
    else:
        what += f"{action}: nothing to remove"
    kept = set(_snapshots_on_disk(target)) - {"quarantine"}
    original = tree_digest(run) + tree_digest(local) if action == "copy" else None
    if action == "lose-journal":
        before = tree_digest(target)
        out = train(target, *over)
        if not (clean_error(out) and tree_digest(target) == before):
            return Trial("operator", n, what, "SILENT", f"exit {out.returncode}: " + (out.stderr.strip().splitlines() or ["(no message)"])[-1][:160])
        return Trial("operator", n, what, "refused clearly", out.stderr.strip().splitlines()[-1][:160])
    out = resume_until_done(target, *over)
    if action == "copy":
        if tree_digest(run) + tree_digest(local) != original:
            return Trial("operator", n, what, "NOT EXACT", "the copy's resume wrote into the original run or its local journal")
        if out is not None and out.returncode != 0:
            if not clean_error(out):
                return Trial("operator", n, what, "NOT EXACT", "unclear refusal: " + out.stderr.strip()[-200:])
            what += f" (refused: {out.stderr.strip().splitlines()[-1][:100]})"
            target = run  # the copy was refused: the original must still resume exactly
            out = resume_until_done(run, *over)
    if out is None or out.returncode != 0:
        return Trial("operator", n, what, "NOT EXACT", resume_failure(out))
    quarantined = sorted(p.name for p in (target / "quarantine").glob("step_*")) if (target / "quarantine").is_dir() else []
    lost = sorted(name for name in kept if not (target / name).is_dir()
                  and len([s for s in _snapshots_on_disk(target) if s > name]) < 2)  # save_total_limit=2 rotates only after newer ones
    if quarantined or lost:
        return Trial("operator", n, what, "SNAPSHOT LOST", f"quarantined {quarantined}, deleted {lost}")
    ver = verlj("verify", target)
    if ver.returncode != 0:
        return Trial("operator", n, what, "NOT EXACT", "verify after the resume: " + (ver.stdout.strip().splitlines() or ["?"])[-1][:160])
    same, note = identical(target, ref)
    for p in (run, local, root / f"op{n}-copy", root / f"op{n}-moved"):
        shutil.rmtree(p, ignore_errors=True)
    return Trial("operator", n, what, "exact" if same else "NOT EXACT", note)


# ----------------------------------------------------------------------------- concurrency


def concurrency_trial(root: Path, ref: Path, n: int) -> list[Trial]:
    run = root / f"live{n}"
    cmd = [PYTHON[0], "-m", "verlj.cli", "train", "--output-dir", str(run), *SMALL]
    # stall step 5 so the probes certainly run while training is live
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env(VERLJ_FAILPOINT="step.before_commit:5:sleep=10"), cwd=REPO)
    out: list[Trial] = []
    for line in p.stdout:
        if "[INFO] Step 4:" in line:
            break
    second = train(run, resume=True)
    out.append(Trial("concurrency", n, "a second `verlj train --resume` on the live run",
                     "refused" if clean_error(second) and "is being written by" in second.stderr else "NOT EXACT",
                     (second.stderr.strip().splitlines() or ["?"])[-1][:140]))
    probes = [verlj("inspect", run), verlj("verify", run), verlj("metrics", run, "--csv"), verlj("inspect", run, "--step", 2)]
    rest, err = p.communicate(timeout=300)
    same, note = identical(run, ref)
    ok = all(x.returncode == 0 for x in probes) and p.returncode == 0 and same
    out.append(Trial("concurrency", n, "inspect, verify, metrics during training", "undisturbed" if ok else "NOT EXACT",
                     note or ("" if ok else f"probe exits {[x.returncode for x in probes]}, train {p.returncode}")))
    shutil.rmtree(run, ignore_errors=True)
    return out


def settled(run: Path, local: Path, steps: int, timeout: float = 120) -> None:
    """Wait until `steps` steps are committed in `local` and shipped to `run` (a trainer held in the next one)."""
    from verlj.journal import Journal, segments

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with Journal.open_reader(local) as j:
                done = j.last_step()
            found = segments.scan(run / "journal")
            if done == steps and (found.last_step or 0) == steps and found.segments and not found.leftovers:
                time.sleep(0.3)  # the shipment of the metadata that follows a step
                return
        except Exception:  # noqa: BLE001 - not created yet
            pass
        time.sleep(0.05)


def two_writers_trial(root: Path, ref: Path, rng: random.Random, n: int) -> Trial:
    """A second trainer, from another local directory, on a shipped run that a first one trains."""
    run = root / f"two{n}"
    first, second = rng.sample(["A", "B"], 2)
    stall = rng.randint(1, TARGET - 1)  # hold the first inside a random step so the second surely meets it live
    cmd = [PYTHON[0], "-m", "verlj.cli", "train", "--output-dir", str(run), *SMALL, f"journal.local_dir={root / f'two{n}-{first}'}"]
    live = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env(VERLJ_FAILPOINT=f"step.before_commit:{stall}:sleep=15"))
    settled(run, root / f"two{n}-{first}", stall - 1)  # held in its step, everything before it shipped
    time.sleep(rng.uniform(0, 1.0))
    resume = rng.random() < 0.8
    before = tree_digest(run)
    out = train(run, f"journal.local_dir={root / f'two{n}-{second}'}", resume=resume)
    touched = tree_digest(run) != before
    _, err = live.communicate(timeout=300)
    what = f"{first} trains (held in step {stall}); {second} starts {'with' if resume else 'without'} --resume"
    if not (clean_error(out) and "is being written by" in out.stderr):
        return Trial("two-writers", n, what, "NOT REFUSED", f"exit {out.returncode}: " + (out.stderr.strip().splitlines() or ["?"])[-1][:140])
    if touched:
        return Trial("two-writers", n, what, "TOUCHED", "the refused trainer changed the live run's files")
    if live.returncode != 0:
        return Trial("two-writers", n, what, "NOT EXACT", f"the first trainer exited {live.returncode}: " + (err.strip().splitlines() or ["?"])[-1][:140])
    same, note = identical(run, ref)
    shutil.rmtree(run, ignore_errors=True)
    return Trial("two-writers", n, what, "refused" if same else "NOT EXACT", note or (out.stderr.strip().splitlines() or ["?"])[-1][:140])


# ----------------------------------------------------------------------------- bad input


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    if root.exists():
        for p in sorted(root.rglob("*")):
            # lock files, rewritten by any opener, and the writers' claims (RUN/writer), added to by every start
            if p.is_file() and p.name not in ("lock.mdb", "writer.lock") and "writer" not in p.relative_to(root).parts:
                h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


QUICK_BAD_INPUT = {"unknown key", "malformed YAML", "missing model directory", "existing run without --resume",
                   "journal from a newer schema: resume", "malformed --where"}


def bad_input_trials(root: Path, finished: Path, quick: bool = False) -> list[Trial]:
    from verlj.journal import Journal

    existing = root / "existing"
    shutil.copytree(finished, existing, symlinks=True)
    (root / "bad.yaml").write_text("trainer: {total_steps: [}\n")
    (root / "list.yaml").write_text("- 1\n")
    (root / "data.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
    newer = root / "newer"
    shutil.copytree(finished, newer, symlinks=True)
    with Journal.open_writer(newer / "journal") as j:
        j.writer.append_step(j.last_step() + 1, [{"type": "metrics", "v": 99, "values": {}}])
    notarun = root / "notarun"
    notarun.mkdir()
    (notarun / "notes.txt").write_text("mine")
    fresh = root / "fresh"
    cases = [
        ("unknown key", ["train", "-o", fresh, "trainer.totl_steps=3"], fresh, 2),
        ("wrong type", ["train", "-o", fresh, "trainer.total_steps=many"], fresh, 2),
        ("bad value", ["train", "-o", fresh, "distributed.zero_stage=7"], fresh, 2),
        ("malformed override", ["train", "-o", fresh, "trainer"], fresh, 2),
        ("malformed YAML", ["train", "--config", root / "bad.yaml", "-o", fresh], fresh, 2),
        ("YAML that is not a mapping", ["train", "--config", root / "list.yaml", "-o", fresh], fresh, 2),
        ("missing config file", ["train", "--config", root / "none.yaml", "-o", fresh], fresh, 2),
        ("missing model directory", ["train", "-o", fresh, "model.actor.model_name_or_path=/no/model"], fresh, 1),
        ("dataset without the fields", ["train", "-o", fresh, f"data.train_dataset={root / 'data.jsonl'}", "rollout.reward_fn=builtin:add"], fresh, 1),
        ("missing dataset", ["train", "-o", fresh, "data.train_dataset=/no/data.jsonl", "rollout.reward_fn=builtin:add"], fresh, 1),
        ("unknown reward function", ["train", "-o", fresh, "rollout.reward_fn=no_such_mod:f"], fresh, 1),
        ("existing run without --resume", ["train", "-o", existing, *SMALL], existing, 1),
        ("state-changing key on resume", ["train", "-o", existing, *SMALL, "algorithm.name=ppo", "--resume"], existing, 1),
        ("resume of a directory that is not a run", ["train", "-o", notarun, "--resume"], notarun, 1),
        ("journal from a newer schema: replay", ["replay", newer, "--to-step", TARGET + 1], newer, 1),
        ("journal from a newer schema: resume", ["train", "-o", newer, *SMALL, "trainer.total_steps=12", "--resume"], newer, 1),
        ("replay step out of range", ["replay", existing, "--to-step", 999], existing, 2),
        ("inspect a non-run", ["inspect", notarun], notarun, 1),
        ("inspect step out of range", ["inspect", existing, "--step", 999], existing, 2),
        ("malformed --where", ["find", existing, "--where", "loss >>> 3"], existing, 2),
        ("verify a missing path", ["verify", root / "missing"], root / "missing", 2),
    ]
    if quick:
        cases = [c for c in cases if c[0] in QUICK_BAD_INPUT]
    out = []
    for name, args, watched, code in cases:
        before = tree_digest(watched)
        r = verlj(*args)
        one_line = r.returncode == code and "Traceback" not in r.stdout + r.stderr and r.stderr.count("error:") == 1
        untouched = tree_digest(watched) == before
        outcome = "clear error" if one_line and untouched else "NOT EXACT"
        note = (r.stderr.strip().splitlines() or ["(no message)"])[-1][:150]
        if not untouched:
            note = "WROTE INTO THE DIRECTORY; " + note
        if r.returncode != code:
            note = f"exit {r.returncode}, expected {code}; " + note
        out.append(Trial("bad-input", len(out) + 1, name, outcome, note))
    return out


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--corruptions", type=int, default=50)
    ap.add_argument("--disk-full", type=int, default=2)
    ap.add_argument("--node-losses", type=int, default=20)
    ap.add_argument("--two-writers", type=int, default=6)
    ap.add_argument("--asyncs", type=int, default=50)
    ap.add_argument("--bitflips", type=int, default=24)
    ap.add_argument("--operators", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=30)
    ap.add_argument("--partials", type=int, default=30, help="trials of the partial kind (rollout.partial)")
    ap.add_argument("--effects", type=int, default=30, help="trials of the effects kind (rollout.tools)")
    ap.add_argument("--mirrors", type=int, default=30, help="trials of the mirror kind (trainer.mirror_interval)")
    ap.add_argument("--fleet", type=int, default=30, help="trials of the fleet kind (rollout.fleet=ray; needs ray)")
    ap.add_argument("--async-engine", default="hf", choices=["hf", "vllm"], help="what the async trials' generator runs")
    ap.add_argument("--async-order", default="both", choices=["step", "completion", "both"],
                    help="the async trials' rollout.async_order (both: alternate)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a few trials of each kind (the test suite runs this)")
    ap.add_argument("--kinds", default=None, help=f"comma-separated, of {','.join(KINDS)} (default: all; --quick: all but fleet)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter each trial's `-m verlj.cli ...` runs under (default: this one; the test suite "
                         "passes its fork server's, tests/harness/forkclient.py)")
    args = ap.parse_args()
    if not (os.path.isfile(args.python) and os.access(args.python, os.X_OK)):
        print(f"error: --python {args.python} is not an executable file", file=sys.stderr)
        return 2
    PYTHON[0] = args.python
    if args.quick:
        args.kills, args.corruptions, args.disk_full, args.node_losses, args.two_writers, args.asyncs = 1, 3, 1, 1, 1, 1
        args.bitflips, args.operators, args.fleet, args.episodes, args.partials, args.effects, args.mirrors = 1, 3, 1, 1, 1, 1, 1
    kinds = set(args.kinds.split(",")) if args.kinds else set(KINDS) - ({"fleet"} if args.quick else set())
    if kinds - set(KINDS):
        print(f"error: unknown kind(s) {', '.join(sorted(kinds - set(KINDS)))} in --kinds; the kinds are {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if args.async_engine == "vllm":
        ASYNC.append("rollout.engine=vllm")
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="verlj-faults-"))
    trials: list[Trial] = []
    t0 = time.time()
    cluster = contextlib.ExitStack()
    try:
        ref = root / "ref"  # the uninterrupted run, for the kinds that compare against it
        if kinds & {"kill", "disk-full", "node-loss", "concurrency", "two-writers", "operator", "mirror"}:
            assert train(ref, resume=False).returncode == 0, "reference run failed"
        finished = root / "finished"  # a finished run to damage: keeps every snapshot
        if kinds & {"corruption", "bad-input"}:
            assert train(finished, "trainer.save_total_limit=0", resume=False).returncode == 0
        ref10 = root / "ref10"
        if "corruption" in kinds:
            assert train(ref10, "trainer.total_steps=10", resume=False).returncode == 0
        async_refs: dict[int, Path] = {}
        if "async" in kinds:
            for k in () if args.async_order == "completion" else (1,) if args.quick else (1, 4):
                async_refs[k] = root / f"ref_async{k}"
                assert train(async_refs[k], *ASYNC, f"rollout.max_staleness={k}", resume=False).returncode == 0
        async_counts: Counter = Counter()
        flip_refs: dict[int, Path] = {}
        flip_counts: Counter = Counter()
        fleet_counts: Counter = Counter()

        def record(t: Trial) -> None:
            trials.append(t)
            print(f"[{time.time() - t0:6.0f}s] {t.kind:11s} #{t.n:<3d} {t.outcome:32s} {t.what}" + (f"  ({t.note})" if t.note else ""), flush=True)

        if "kill" in kinds:
            for n in range(1, args.kills + 1):
                record(kill_trial(root, ref, rng, n))
        if "corruption" in kinds:
            for n in range(1, args.corruptions + 1):
                record(corruption_trial(root, finished, ref10, rng, n))
        if "disk-full" in kinds:
            for n in range(1, args.disk_full + 1):
                record(disk_full_trial(root, ref, n, size_kb=[96, 512, 160, 2048][(n - 1) % 4]))
        if "node-loss" in kinds:
            for n in range(1, args.node_losses + 1):
                record(node_loss_trial(root, ref, rng, n))
        if "concurrency" in kinds:
            for t in concurrency_trial(root, ref, 1):
                record(t)
        if "two-writers" in kinds:
            for n in range(1, args.two_writers + 1):
                record(two_writers_trial(root, ref, rng, n))
        if "async" in kinds:
            for n in range(1, args.asyncs + 1):
                completion = args.async_order == "completion" or (args.async_order == "both" and n % 2 == 0)
                record(completion_trial(root, rng, n, async_counts) if completion else async_trial(root, async_refs, rng, n, async_counts))
        if "bitflip" in kinds:
            for n in range(1, args.bitflips + 1):
                record(bitflip_trial(root, flip_refs, rng, n, flip_counts))
        if "bad-input" in kinds:
            for t in bad_input_trials(root, finished, quick=args.quick):
                record(t)
        if "operator" in kinds:
            for n in range(1, args.operators + 1):
                record(operator_trial(root, ref, rng, n))
        episode_refs: dict[tuple[str, str], Path] = {}
        episode_counts: Counter = Counter()
        if "episodes" in kinds:
            for n in range(1, args.episodes + 1):
                record(episodes_trial(root, episode_refs, rng, n, episode_counts))
        partial_counts: Counter = Counter()
        if "partial" in kinds:
            for n in range(1, args.partials + 1):
                record(partial_trial(root, rng, n, partial_counts))
        effect_refs: dict[str, Path] = {}
        effect_counts: Counter = Counter()
        if "effects" in kinds:
            for n in range(1, args.effects + 1):
                record(effects_trial(root, effect_refs, rng, n, effect_counts))
        mirror_counts: Counter = Counter()
        if "mirror" in kinds:
            for n in range(1, args.mirrors + 1):
                record(mirror_trial(root, ref, rng, n, mirror_counts))
        if "fleet" in kinds:
            ray = cluster.enter_context(RayCluster())
            fleet_ref = root / "ref_fleet"  # step order, uninterrupted, on the same cluster
            out = train(fleet_ref, *FLEET, "rollout.async_order=step", resume=False, RAY_ADDRESS=ray.address)
            assert out.returncode == 0, "fleet reference run failed: " + out.stderr[-2000:]
            for n in range(1, args.fleet + 1):
                record(fleet_trial(root, fleet_ref, ray, rng, n, fleet_counts))
    finally:
        cluster.close()  # the campaign's Ray cluster stopped, on Ctrl-C too
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"{'kind':12s} {'trials':>6s}  outcomes")
    for kind in KINDS:
        ts = [t for t in trials if t.kind == kind]
        if ts:
            counts = Counter(t.outcome for t in ts)
            print(f"{kind:12s} {len(ts):6d}  " + ", ".join(f"{k}: {v}" for k, v in counts.most_common()))
    if any(t.kind == "async" for t in trials):
        print(f"async: completed samples lost {async_counts['lost']}, prompts trained more {async_counts['duplicated']}, "
              f"fewer or out of order {async_counts['skipped']} (step order: against the uninterrupted runs; completion order: "
              f"against the journal and the dataset's order); completion order ({async_counts['completion']} trials): "
              f"{async_counts['regenerated']} groups generated again after a kill, {async_counts['wrong_version']} of their samples "
              "not from the version resumed with")
    if any(t.kind == "bitflip" for t in trials):
        print(f"bitflip: {flip_counts['clean']} clean steps re-executed, {flip_counts['false']} false alarms; "
              f"{flip_counts['unchecked']} steps not checked (between a flip and the next snapshot); "
              f"the flip changed the run's state in {flip_counts['changed_run']} trials")
    if any(t.kind == "episodes" for t in trials):
        print(f"episodes: completion order ({episode_counts['episodes']} trials): {episode_counts['durable_turns']} durable turns of episodes "
              f"in flight at a kill went on after it; {episode_counts['regenerated']} groups asked again, "
              f"{episode_counts['lost']} completed samples lost, {episode_counts['duplicated']} trained or arrived twice")
    if any(t.kind == "partial" for t in trials):
        print(f"partial: {partial_counts['partial']} trials: {partial_counts['continued']} groups went on from durable tokens after a kill "
              f"({partial_counts['durable_tokens']} tokens never generated again); {partial_counts['regenerated']} groups asked again, "
              f"{partial_counts['lost']} completed samples lost, {partial_counts['duplicated']} trained or arrived twice")
    if any(t.kind == "effects" for t in trials):
        print(f"effects: {effect_counts['trials']} trials: {effect_counts['effects']} effects applied, none twice; "
              f"{effect_counts['from_journal']} tool calls answered from the journal, {effect_counts['reconciled']} unknown outcomes "
              f"reconciled by their keys, {effect_counts['unresolved']} episodes unresolved (keyless, no reconcile), none trained")
    if any(t.kind == "mirror" for t in trials):
        print(f"mirror: resumes from a memory mirror {mirror_counts['from_mirror']}, from a snapshot on disk {mirror_counts['from_disk']}, "
              f"from the initial state {mirror_counts['from_start']}")
    if any(t.kind == "fleet" for t in trials):
        print(f"fleet: {fleet_counts['deaths']} actor deaths counted by the fleet, {fleet_counts['restarts']} trainer restarts by the "
              f"supervisor; completion order: {fleet_counts['lost']} completed samples lost, {fleet_counts['duplicated']} trained or "
              f"arrived twice, {fleet_counts['skipped']} prompts out of the dataset's order, {fleet_counts['regenerated']} groups "
              f"generated again after a trainer kill, {fleet_counts['wrong_version']} of their samples not from the version resumed with")
    bad = [t for t in trials if not t.ok and t.outcome != "skipped"]
    silent = sum(1 for t in trials if t.outcome == "SILENT")
    print(f"\n{len(trials)} trials, {len(bad)} failed, {silent} silent, in {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
