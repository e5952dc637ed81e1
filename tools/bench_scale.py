"""The scale ladder: verlj and TRL's GRPOTrainer side by side on Qwen2-shaped models of growing size.

    python tools/bench_scale.py --trl-python VENV/bin/python                  # 20m,135m,500m x fp32,bf16: hours, an idle machine
    python tools/bench_scale.py --rungs 135m --dtype bf16 --steps 8 --k 4 --trl-python VENV/bin/python
    python tools/bench_scale.py --rungs tiny --steps 2 --k 1 --arms verlj     # the smoke: a ~1M model, well under a minute

Each rung is a random-init Qwen2 (grouped-query attention, tied embeddings) made here with transformers'
Qwen2ForCausalLM and saved with save_pretrained, verlj's character tokenizer saved beside it (nothing is
downloaded): tiny (~1M), 20m (~21M), 135m (~135M), 500m (~507M); the exact counts are printed. Both arms
train the goodput bench's job on it (tools/bench_goodput.py: its prompts, its reward builtin:add, 4 prompts x
4 samples x up to 32 tokens, lr 1e-3, one thread, no KL term and so no reference model: TRL's beta=0 and
verlj's model.actor.use_kl_loss=false), in fp32 or in bf16 (verlj: trainer.precision=bf16, DeepSpeed's bf16
with fp32 masters; TRL: Hugging Face's bf16=True, fp32 weights with bf16 autocast). Per rung and dtype:

  step s        median step time over the steps after --warmup, each arm's wall time from one step's end to
                the next's as this driver sees it (verlj's "[INFO] Step N" lines, TRL's on_step_end callback),
                logging included, no snapshot or checkpoint among them
  RSS MiB       peak resident memory of the training process (os.wait4's rusage)
  exact %       verlj: the exactness work's share of a step, the state fingerprint (timing_s/fingerprint) +
                the stage digests (timing_s/stages, partly inside the update) + the journal commit
                (timing_s/commit), medians over the timed steps (goal <= 1% from 135m up)
  snap MiB, s   snapshot bytes and a synchronous snapshot's write time (verlj: the snapshot of the state
                after step a, written again --repeats times in a separate process, the median of write + fsync +
                publish; TRL: its
                checkpoint-a directory and the time from on_step_end to on_save of that step)
  blocked       verlj, trainer.async_save=true: the time the loop was held, by save() (DeepSpeed's
                save_checkpoint on the loop's thread: the state dicts, holding the live tensors) and by the
                next update's wait for the write (Checkpointer.settle, after the next step's collect, which
                this probe runs as the loop does), over the async snapshot's write time (from save() until
                published, in the background), medians of --repeats (goal <= 10%)
  recover       recovery (load the snapshot at a, replay k journaled steps, checking each) over re-running
                the k steps live from the same snapshot (generation, reward, update: what a checkpoint-only
                trainer redoes), each in a fresh process of this script (--recovery-probe): launch to exit,
                and in brackets the same without the interpreter's start and imports (from the trainer's
                construction on); in CPU seconds (user + system: one thread, so about the wall time of an idle
                machine, and far less inflated by a shared one), wall seconds in the goal's line (goal <= 0.5x)
  journal KiB   the journal's bytes (journal/*.mdb) per step
  mirror        with --mirror: the same job trained again with trainer.mirror_interval=1 (the state after each
                committed step mirrored into /dev/shm in the background) under the supervisor (trainer.max_restarts=1,
                its standby built), the trainer SIGKILLed in step a+k+1 before its commit: its median step over the
                plain run's (what mirroring costs), the loop held by each mirror (timing_s/mirror: the save on the
                loop's thread and the next update's wait for the write) as a share of its step, the seconds from the
                kill (the supervisor's line) to step a+k+1 trained again, and recovery (those seconds less one step:
                back at step a+k, from the mirror of a+k, nothing replayed) over re-running the k steps since the
                snapshot at a (goals: held <= 0.5% of a step, <= 2% of step time in all, the next step within 2
                step-times of the kill, recovery <= 0.1x)
and the ratios verlj/TRL of step time and peak RSS (goals <= 1). verlj trains a = max(--k, --warmup + --steps)
+ 1 steps with one snapshot at a, then k more steps, and one more (the final snapshot, past a+k): the steps
timed are those after --warmup. TRL trains a steps, its checkpoint at a.

Load: the arms and rungs run one after another, each using one core; nothing else should run meanwhile
(the 135m and 500m rungs need an idle machine; 500m about 10 GiB of memory: verlj's process peaked at
9.9 GiB in fp32, TRL's at 9.1, and about 25 GiB of free disk under $TMPDIR for its snapshots of 5.7-6.6 GiB; the
500m rung took 12 minutes in fp32 and 10 in bf16, both arms, on an idle 2-core machine). Times are wall-clock,
meaningful side by side as ratios.
`--rungs tiny --arms verlj` is a smoke of the tool, not a figure; the test suite does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_goodput import ENV, LR, MODEL, REPO, TRL_SCRIPT, write_rows
from bench_recovery import Silent  # a reporter that says nothing

# Qwen2 shapes: hidden, layers, attention heads, key/value heads, MLP width. 135m is SmolLM-135M's width with
# more layers, 500m Qwen2-0.5B's with 34 layers (a character vocabulary has no 136M-parameter embedding)
RUNGS = {"tiny": (128, 4, 4, 2, 512), "20m": (384, 12, 6, 2, 1152), "135m": (576, 38, 9, 3, 1536), "500m": (896, 34, 14, 2, 4864)}
# the goodput bench's job without its built-in model, without the KL term (TRL: beta=0), without counting calls
JOB = [o for o in MODEL if not o.startswith("model.tiny.")] + ["model.actor.use_kl_loss=false", "trainer.save_total_limit=0"]
TIMED = ("timing_s/step", "timing_s/commit")
EXACT = ("timing_s/fingerprint", "timing_s/stages", "timing_s/commit")


# ----------------------------------------------------------------------------- the models


def make_model(root: Path, rung: str) -> tuple[Path, int]:
    """A random-init Qwen2 of the rung's shape and verlj's character tokenizer in a Hugging Face
    directory (with the job's prompts as rows.json for TRL); its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verlj.engine.config import make_config
    from verlj.engine.rl.models import BUILTIN_TINY, load_tokenizer

    cfg = make_config(None, JOB)
    tok = load_tokenizer(BUILTIN_TINY, cfg=cfg)
    hidden, layers, heads, kv, mlp = RUNGS[rung]
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=True, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    out = root / f"model-{rung}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_rows(out, cfg)
    return out, sum(p.numel() for p in model.parameters())


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def launch(cmd: list[str], env: dict | None = None) -> tuple[float, int, list[tuple[float, str]], int, float]:
    """Run `cmd` to its end: (wall s, exit status, its output lines with the time each arrived, peak RSS bytes,
    CPU s: user + system, which a shared machine inflates far less than wall time)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env={**os.environ, **ENV, **(env or {})})
    assert p.stdout is not None
    lines = [(time.perf_counter(), line) for line in p.stdout]
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, p.returncode, lines, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def step_time(ends: dict[int, float], warmup: int, last: int) -> float:
    """The median time from one step's end to the next's, for the steps warmup+1..last (none of them follows
    a snapshot: the first is taken after step `last`)."""
    gaps = [ends[s] - ends[s - 1] for s in range(max(warmup, 1) + 1, last + 1) if s in ends and s - 1 in ends]
    if not gaps:
        raise SystemExit(f"no step ends seen for steps {warmup + 1}..{last}: nothing to time")
    return statistics.median(gaps)


def failed(what: str, rc: int, lines: list[tuple[float, str]]) -> SystemExit:
    return SystemExit(f"{what} exited {rc}:\n{''.join(line for _, line in lines[-20:])}")


# ----------------------------------------------------------------------------- verlj


def verlj_arm(root: Path, model: Path, dtype: str, args) -> dict:
    run, a = root / f"verlj-{model.name}-{dtype}", max(args.k, args.warmup + args.steps) + 1
    cmd = [sys.executable, "-m", "verlj.cli", "train", "-o", str(run), *JOB, f"model.actor.model_name_or_path={model}",
           f"trainer.precision={dtype}", f"trainer.total_steps={a + args.k + 1}", f"trainer.save_interval={a}"]
    _, rc, lines, rss, _ = launch(cmd)
    if rc != 0:
        raise failed("verlj train", rc, lines)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if args.warmup < r["step"] <= a]
    inside = statistics.median(sum(r[k] for k in TIMED) for r in timed)
    exact = statistics.median(sum(r.get(k, 0.0) for k in EXACT) for r in timed)
    commit = statistics.median(r["timing_s/commit"] for r in timed)
    step = step_time({int(m.group(1)): t for t, line in lines if (m := re.search(r"\[INFO\] Step (\d+): ", line))}, args.warmup, a)
    probe = subprocess.run([sys.executable, __file__, "--snapshot-probe", str(run), str(a), "--repeats", str(args.repeats)], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, **ENV})
    if probe.returncode != 0:
        raise SystemExit(f"the snapshot probe of {run} exited {probe.returncode}:\n{probe.stderr[-3000:]}")
    snap = json.loads(probe.stdout.strip().splitlines()[-1])
    replay = recovery_launch(run, a, args.k, "replay")
    rerun = recovery_launch(run, a, args.k, "live")
    journal = sum(p.stat().st_size for p in (run / "journal").glob("*.mdb"))
    shutil.rmtree(run, ignore_errors=True)
    out = {"step": step, "rss": rss, "exact": exact / inside, "commit": commit / inside, "snap_bytes": snap["bytes"],
           "snap_s": snap["sync_s"], "async_s": snap["async_s"], "blocked_s": snap["blocked_s"], "replay": replay,
           "rerun": rerun, "journal_step": journal / (a + args.k + 1)}
    if args.mirror:
        out["mirror"] = mirror_arm(run.parent / f"{run.name}-mirror", cmd, a, args)
    return out


def mirror_arm(run: Path, cmd: list[str], a: int, args) -> dict:
    """The verlj arm's job again with trainer.mirror_interval=1 under the supervisor (trainer.max_restarts=1, its
    standby built), the trainer SIGKILLed in step a+k+1 before its commit (the mirror of step a+k long written: a
    mirror takes a fraction of a step): the seconds from the supervisor's line that the trainer was killed to the
    line of step a+k+1 trained again, and what the restart loaded."""
    from verlj.engine.loop.mirror import mirror_root

    k = args.k
    cmd = [*cmd[:cmd.index("-o") + 1], str(run), *cmd[cmd.index("-o") + 2:], "trainer.mirror_interval=1", "trainer.max_restarts=1"]
    _, rc, lines, _, _ = launch(cmd, {"VERLJ_FAILPOINT": f"step.before_commit:{a + k + 1}"})
    if rc != 0:
        raise failed("verlj train (mirrored, killed once)", rc, lines)
    killed = next((t for t, line in lines if "was killed by SIGKILL; restarting it" in line), None)
    back = [t for t, line in lines if killed is not None and t > killed and f"[INFO] Step {a + k + 1}: reward" in line]
    loaded = next((line.strip() for t, line in lines if "Resuming from checkpoint" in line), "")
    if killed is None or not back or f"(the memory mirror of step {a + k})" not in loaded:
        raise failed(f"the mirrored run (no restart from the mirror of step {a + k}: {loaded or 'none'})", rc, lines)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if args.warmup < r["step"] <= a and "timing_s/mirror" in r]
    step = step_time({int(m.group(1)): t for t, line in lines if t < killed and (m := re.search(r"\[INFO\] Step (\d+): ", line))},
                     args.warmup, a)
    shutil.rmtree(mirror_root(run, None), ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    return {"step": step, "held": statistics.median(r["timing_s/mirror"] / r["timing_s/step"] for r in timed),
            "to_next": back[0] - killed,
            "standby": any("Took the trainer the standby built" in line for _, line in lines)}


def recovery_launch(run: Path, a: int, k: int, how: str) -> dict:
    """A fresh process that brings the run's state from its snapshot at `a` to step a+k, `how` = replay or
    live (recovery_probe): {wall, cpu: launch to exit; inside_wall, inside_cpu: from the trainer's
    construction to the end}, seconds."""
    wall, rc, lines, _, cpu = launch([sys.executable, __file__, "--recovery-probe", str(run), str(a), str(k), how])
    if rc != 0:
        raise failed(f"the recovery probe ({how}) of {run}", rc, lines)
    return {"wall": wall, "cpu": cpu, **json.loads(lines[-1][1])}


def recovery_probe(run: Path, a: int, k: int, how: str) -> dict:
    """In this process: the run's trainer made, its snapshot at `a` restored, then steps a+1..a+k brought
    back. replay: read from the journal and applied, each step's fingerprint, stages and metrics checked
    (loop.recovery.replay, as `verlj replay` and `train --resume` do); live: collected (generation, reward)
    and applied again, as a trainer without a journal re-runs them from its checkpoint."""
    from verlj.engine.config import config_from_dict
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.loop.checkpointer import make_run
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.loop.recovery import replay, restore
    from verlj.engine.rl.trainer import Trainer

    journal = Ledger.open_reader(run)
    cfg = config_from_dict(journal.identity.first_config())
    rt = setup(cfg)
    configure_determinism(cfg)
    t, c = time.perf_counter(), time.process_time()
    r = make_run(run, rt, Trainer(cfg, rt), Silent(), journal)
    restored = restore(r, a)
    if how == "replay":
        replay(r, journal.history(), restored, a + k)
    else:
        for step in range(a + 1, a + k + 1):
            inputs = r.source.collect(step)
            samples = r.trainer.take(step, inputs)
            r.trainer.advance_sampler(inputs)
            r.trainer.apply(step, inputs, samples)
            r.source.weights_changed()
    inside = {"inside_wall": time.perf_counter() - t, "inside_cpu": time.process_time() - c}
    r.source.close()
    r.trainer.close()
    journal.close()
    return inside


def snapshot_probe(run: Path, step: int, repeats: int) -> dict:
    """In this process: the run's state restored from its snapshot at `step` (Adam's moments included), then
    written again into a scratch run `repeats` times each, synchronously (its bytes and write time) and with
    trainer.async_save, the next step collected meanwhile as the loop does (the time save() and the update's
    wait for the write, Checkpointer.settle, hold the loop, and the write's time until published): medians."""
    import copy

    from verlj.engine.config import config_from_dict
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.loop.checkpointer import make_run
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.loop.recovery import restore
    from verlj.engine.rl.trainer import Trainer
    from verlj.journal import Journal

    journal = Ledger.open_reader(run)
    cfg = config_from_dict(journal.identity.first_config())
    rt = setup(cfg)
    configure_determinism(cfg)
    trainer = Trainer(cfg, rt)
    restored = make_run(run, rt, trainer, Silent(), journal)
    restore(restored, step)
    scratch = run.parent / f"{run.name}-snaps"
    scratch.mkdir()
    ledger = Ledger(Journal.open_writer(scratch / "journal"))
    times: dict[str, list[float]] = {"sync_s": [], "async_s": [], "blocked_s": []}
    out: dict = {}
    for i in range(repeats):  # alternating, medians: one write of each says little on a busy machine
        for async_save in (False, True):
            c = copy.deepcopy(cfg)
            c.trainer.async_save, c.trainer.save_total_limit = async_save, 0
            trainer.set_config(c)  # the checkpointer reads the trainer's config
            ckpt = make_run(scratch, rt, trainer, Silent(), ledger).ckpt
            at = step + 2 * i + int(async_save)
            t = time.perf_counter()
            ckpt.save(at, "bench")
            if async_save:  # as the loop goes on: the next step collected while the snapshot is written, then its update waits
                restored.source.collect(step + 1)
                ckpt.settle()
            ckpt.wait()
            times["async_s" if async_save else "sync_s"].append(ckpt.write_s if async_save else time.perf_counter() - t)
            if async_save:
                times["blocked_s"].append(ckpt.blocked_s)
            out.setdefault("bytes", du(scratch / f"step_{at:05d}"))
            shutil.rmtree(scratch / f"step_{at:05d}")  # the 500m rung's are 6 GiB each
    out.update({k: statistics.median(v) for k, v in times.items()})
    ledger.close()
    journal.close()
    restored.source.close()
    trainer.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- TRL


def trl_arm(root: Path, model: Path, dtype: str, args) -> dict:
    a = max(args.k, args.warmup + args.steps) + 1
    out = root / f"trl-{model.name}-{dtype}"
    out.mkdir()
    script = root / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    _, rc, lines, rss, _ = launch([args.trl_python, str(script), str(model), str(out), str(a), str(a), "", str(LR), dtype])
    if rc != 0:
        raise failed("the TRL script", rc, lines)
    said = {(m.group(1), int(m.group(2))): (t, float(m.group(3))) for t, line in lines
            if (m := re.match(r"TRL (STEP|SAVED) (\d+) ([\d.]+)", line))}  # (when it arrived, when the script said it)
    if ("SAVED", a) not in said or ("STEP", a) not in said:
        raise failed(f"the TRL script (no checkpoint at step {a})", rc, lines)
    step = step_time({s: t for (what, s), (t, _) in said.items() if what == "STEP"}, args.warmup, a)
    row = {"step": step, "rss": rss, "snap_bytes": du(out / f"checkpoint-{a}"), "snap_s": said["SAVED", a][1] - said["STEP", a][1]}
    shutil.rmtree(out, ignore_errors=True)
    return row


def trl_version(py: str) -> str | None:
    probe = subprocess.run([py, "-c", "import trl, verlj.engine; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


# ----------------------------------------------------------------------------- the table


def goal(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def recovered(replay: dict, rerun: dict) -> str:
    """The recovery goal's line: CPU seconds (the goal), and wall seconds beside them."""
    ok = goal(replay["cpu"] <= 0.5 * rerun["cpu"])
    return (f"recover {replay['cpu']:.1f} CPU s / re-run {rerun['cpu']:.1f} <= 0.5x: {ok} (wall {replay['wall']:.1f} s / "
            f"{rerun['wall']:.1f} s; from the trainer's construction on, CPU {replay['inside_cpu']:.1f} s / {rerun['inside_cpu']:.1f} s, "
            f"wall {replay['inside_wall']:.1f} s / {rerun['inside_wall']:.1f} s)")


def report(rows: list[tuple[str, int, str, dict, dict | None]], args) -> None:
    print(f"\n{'rung':<6} {'params':>12} {'dtype':<5} {'arm':<6} {'step s':>8} {'RSS MiB':>8} {'exact %':>8} {'snap MiB':>9} {'snap s':>7} "
          f"{'blocked':>8} {'recover':>15} {'journal KiB':>12}")
    for rung, params, dtype, v, t in rows:
        print(f"{rung:<6} {params:>12,} {dtype:<5} {'verlj':<6} {v['step']:>8.3f} {v['rss'] / 2**20:>8.0f} {v['exact']:>8.2%} "
              f"{v['snap_bytes'] / 2**20:>9.1f} {v['snap_s']:>7.2f} {v['blocked_s'] / v['async_s']:>8.1%} "
              f"{v['replay']['cpu'] / v['rerun']['cpu']:>7.2f}x ({v['replay']['inside_cpu'] / v['rerun']['inside_cpu']:.2f}x) {v['journal_step'] / 1024:>12.1f}")
        if t is not None:
            print(f"{'':<6} {'':>12} {'':<5} {'trl':<6} {t['step']:>8.3f} {t['rss'] / 2**20:>8.0f} {'-':>8} {t['snap_bytes'] / 2**20:>9.1f} "
                  f"{t['snap_s']:>7.2f} {'-':>8} {'-':>15} {'-':>12}")
    print("\ngoals:")
    for rung, params, dtype, v, t in rows:
        parts = [f"blocked {v['blocked_s']:.3f} s of {v['async_s']:.2f} s <= 10%: {goal(v['blocked_s'] <= 0.1 * v['async_s'])}",
                 recovered(v['replay'], v['rerun'])]
        if params >= 100e6:
            parts.insert(0, f"exactness {v['exact']:.2%} (commit {v['commit']:.2%}) <= 1%: {goal(v['exact'] <= 0.01)}")
        if t is not None:
            parts += [f"step verlj/TRL {v['step'] / t['step']:.2f} <= 1: {goal(v['step'] <= t['step'])}",
                      f"RSS verlj/TRL {v['rss'] / t['rss']:.2f} <= 1: {goal(v['rss'] <= t['rss'])}"]
        print(f"  {rung} {dtype}: " + "; ".join(parts))
        if "mirror" in v:
            m, k = v["mirror"], args.k
            recover = m["to_next"] - m["step"]  # back at the last committed step: the kill's step trained again aside
            print(f"  {rung} {dtype} mirror: {v['snap_bytes'] / 2**20:,.0f} MiB a mirror (two held); held {m['held']:.2%} of a step <= 0.5%: "
                  f"{goal(m['held'] <= 0.005)}; step {m['step']:.3f} s / {v['step']:.3f} s unmirrored = {m['step'] / v['step']:.3f} <= 1.02: "
                  f"{goal(m['step'] <= 1.02 * v['step'])}; killed in step a+k+1, its next step {m['to_next']:.1f} s after the kill "
                  f"<= 2 steps ({2 * m['step']:.1f} s): {goal(m['to_next'] <= 2 * m['step'])}; recovery {recover:.1f} s / re-running the "
                  f"{k} steps since the snapshot {k * m['step']:.1f} s = {recover / (k * m['step']):.2f}x <= 0.1x: "
                  f"{goal(recover <= 0.1 * k * m['step'])} (the standby's trainer {'taken' if m['standby'] else 'NOT taken'})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", default="20m,135m,500m", help=f"of {', '.join(RUNGS)}")
    ap.add_argument("--dtype", default="fp32,bf16", help="fp32, bf16 or both")
    ap.add_argument("--steps", type=int, default=8, help="steps timed, after --warmup")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--k", type=int, default=4, help="steps replayed (and run again) after the snapshot")
    ap.add_argument("--repeats", type=int, default=3, help="verlj's snapshot, sync and async, written this many times each (medians)")
    ap.add_argument("--arms", default="verlj,trl", help="verlj, or verlj,trl")
    ap.add_argument("--mirror", action="store_true", help="also train with trainer.mirror_interval=1 and recover from the mirror")
    ap.add_argument("--trl-python", default=sys.executable, help="an interpreter that imports trl and verlj")
    ap.add_argument("--snapshot-probe", nargs=2, metavar=("RUN", "STEP"), help=argparse.SUPPRESS)
    ap.add_argument("--recovery-probe", nargs=4, metavar=("RUN", "STEP", "K", "HOW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.recovery_probe:
        run, a, k, how = args.recovery_probe
        print(json.dumps(recovery_probe(Path(run), int(a), int(k), how)))
        return 0
    if args.snapshot_probe:
        print(json.dumps(snapshot_probe(Path(args.snapshot_probe[0]), int(args.snapshot_probe[1]), args.repeats)))
        return 0
    rungs, dtypes, arms = args.rungs.split(","), args.dtype.split(","), args.arms.split(",")
    if bad := [r for r in rungs if r not in RUNGS] + [d for d in dtypes if d not in ("fp32", "bf16")] + [a for a in arms if a not in ("verlj", "trl")]:
        ap.error(f"{', '.join(bad)}: not a rung ({', '.join(RUNGS)}), dtype (fp32, bf16) or arm (verlj, trl)")
    if min(args.steps, args.k, args.repeats) < 1 or args.warmup < 0:
        ap.error("--steps, --k and --repeats: at least 1; --warmup: at least 0")
    version = trl_version(args.trl_python) if "trl" in arms else None
    if "trl" in arms and version is None:
        print(f"trl arm skipped: TRL (or verlj, for the reward) cannot be imported by {args.trl_python} (--trl-python)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-scale-"))
    rows = []
    try:
        for rung in rungs:
            model, params = make_model(root, rung)
            for dtype in dtypes:
                t0 = time.perf_counter()
                v = verlj_arm(root, model, dtype, args)
                t = trl_arm(root, model, dtype, args) if version else None
                rows.append((rung, params, dtype, v, t))
                print(f"  {rung} ({params:,} parameters) {dtype}: done in {time.perf_counter() - t0:.0f} s", flush=True)
            shutil.rmtree(model, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"\n{args.steps} steps timed after {args.warmup}, recovery over k={args.k} steps; 4 prompts x 4 samples x up to 32 tokens, "
          f"one thread; {os.cpu_count()} cores, load average {load:.1f} at the end" + (f"; TRL {version}" if version else ""))
    report(rows, args)
    if load > 1.5:
        print(f"WARNING: load average {load:.1f}: other processes shared the machine; these figures are not the machine's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
