"""Goodput under failures: the same job, the same seeded failure schedule, each arm restarted by itself.

    python tools/bench_goodput.py                                  # all arms, mean time between failures 60 s
    python tools/bench_goodput.py --mtbf 20 --steps 60 --arms verlj
    python tools/bench_goodput.py --trl-python /path/to/venv/bin/python   # TRL from another environment

Each arm trains the built-in addition task (its reward builtin:add, partial credit for a near number, so
the weights move from the first steps) on the same tiny Llama (4 layers, 256 wide, responses up to 32
tokens, 4 prompts x 4 samples a step) for 3 untimed warm-up steps, then for --steps steps, twice: once
without failures (its reference: wall time W0, final state), once under the failure schedule (wall
time W): SIGKILLs at times drawn once from --seed (exponential gaps, mean --mtbf seconds, the same
times for every arm), each followed by an automatic restart. It prints, per arm:

  goodput       W0 / W: the share of the wall time that went to training the steps once
  failures      SIGKILLs that landed (fleet: of the trainer / of a generator actor)
  to next s     seconds from a kill to the first step beyond every step reported before it (the
                restart, the replay or the steps trained again, the step cut short), the mean over
                the kills; next to it, step s: W0 / steps, the failure-free wall time a step
  steps lost    steps trained to the end again after a restart (generation, scoring and update redone)
  replayed      steps re-applied from verlj's journal after a restart (the update only: no generation)
  rescored      samples generated and scored more than once: the reward function counts its calls
                (a file beside the run), the run under failures minus its reference (a sample cut off
                mid-generation by a kill is not counted)
  identical     whether the run under failures ends in the reference's state, bit for bit

Arms:
  verlj   `verlj train … trainer.max_restarts=1000` (synchronous rollout: generation in the trainer's
          process, the default): the process you start supervises the trainer and restarts it with
          --resume (the journal holds every committed step; the newest snapshot is loaded and the
          journal replayed, no generation); each failure kills the trainer. identical = every step's
          fingerprint equal.
  mirror  the verlj arm with trainer.mirror_interval=1: the state after each committed step mirrored into
          /dev/shm in the background, and a restart loads the newest whole mirror (replaying at most the one or
          two steps whose mirrors were still being copied) instead of the newest snapshot; its W0 beside the verlj arm's is
          what mirroring every step costs
  fleet   the same with rollout.fleet=ray (2 generator actors, async step order) on a local Ray
          cluster this bench starts once; each failure kills the trainer or one generator actor (a
          coin drawn from --seed, the same for every run): an actor's death is absorbed by the fleet
          (its groups asked again of the other), the trainer's restarts it (new actors). identical =
          every step's fingerprint equal to the fleet's uninterrupted run.
  trl     TRL's GRPOTrainer (the same model, prompts and reward; save_steps --trl-save-steps, as TRL
          users checkpoint), restarted by this driver with resume_from_checkpoint from its newest
          complete checkpoint (one a kill tore mid-save is deleted, as a TRL user would); identical =
          the final weights equal. A restart takes TRL about 30 s on 2 cores: with --mtbf near that,
          most kills land in a restart and the run hardly moves. Skipped with one line when TRL (and
          verlj, for the reward) cannot be imported by --trl-python.
Load: the arms run one after another, each using the whole machine (2 cores here); nothing else
should run meanwhile. Times are wall-clock and meaningful only side by side, as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS, N, RESPONSE, LR = 4, 4, 32, 1e-3
MODEL = ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.intermediate_size=512", "data.max_prompt_length=16",
         f"rollout.max_response_length={RESPONSE}", f"data.prompts_per_step={PROMPTS}", f"rollout.n={N}",
         f"model.actor.micro_batch_size={PROMPTS * N}", f"model.actor.optim.lr={LR}", "logging.progress=lines",
         "rollout.reward_fn=bench_goodput:counted_add"]
FLEET = ["rollout.mode=async", "rollout.async_order=step", "rollout.fleet=ray", "rollout.fleet_size=2"]
TOOLS = str(Path(__file__).resolve().parent)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": TOOLS}
COUNT = "VERLJ_GOODPUT_COUNT"  # the file counted_add appends one byte to per sample scored


def counted_add(prompt: str, response: str, answer: str) -> float:
    """builtin:add, counting its calls in the file $VERLJ_GOODPUT_COUNT names (O_APPEND: one byte a call)."""
    from verlj.engine.rl.rewards import add_reward

    if path := os.environ.get(COUNT):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
    return add_reward(prompt, response, answer)


def scored(run: Path) -> int:
    """Samples the reward function scored for `run` (counted_add's file beside it)."""
    f = run.parent / f"{run.name}.scored"
    return f.stat().st_size if f.exists() else 0


def schedule(seed: int, mtbf: float, horizon: float) -> list[float]:
    """Failure times (seconds from an arm's start), the same for every arm."""
    rng, t, out = random.Random(seed), 0.0, []
    while t < horizon:
        t += rng.expovariate(1.0 / mtbf)
        out.append(t)
    return out


class Killer:
    """SIGKILLs `target()` ((what, pid), or None while there is none) at each scheduled time from start();
    `landed` counts the kills by what."""

    def __init__(self, times: list[float], target):
        self.times, self.target, self.landed, self.when = times, target, Counter(), []
        self.stop = threading.Event()

    def start(self) -> None:
        t0 = time.monotonic()

        def loop():
            for t in self.times:
                if self.stop.wait(max(0.0, t0 + t - time.monotonic())):
                    return
                hit = self.target()
                if hit is not None:
                    try:
                        os.kill(hit[1], signal.SIGKILL)
                        self.landed[hit[0]] += 1
                        self.when.append(time.monotonic())
                    except ProcessLookupError:
                        pass

        threading.Thread(target=loop, daemon=True).start()


def to_next_step(kills: list[float], seen: list[tuple[float, int]]) -> list[float]:
    """For each kill (a time), the seconds until a step beyond every step reported before it was reported:
    the restart, any replay or steps trained again, and the step the kill cut short. Kills after the last
    new step (the run was ending) are left out."""
    out = []
    for t in kills:
        before = max((s for at, s in seen if at <= t), default=0)
        after = [at for at, s in seen if at > t and s > before]
        if after:
            out.append(after[0] - t)
    return out


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# ----------------------------------------------------------------------------- verlj


def verlj_run(run: Path, steps: int, save_interval: int, killer_times: list[float] | None, fleet=None, coins: list[bool] = (),
              extra: tuple[str, ...] = ()) -> dict:
    """One `verlj train` of `steps` steps (with the overrides `extra`); under `killer_times`, supervised
    (trainer.max_restarts) and killed: the trainer, or (fleet, where coins[i] says so) one of the fleet's generator actors."""
    cmd = [sys.executable, "-m", "verlj.cli", "train", "-o", str(run), *MODEL, *(FLEET if fleet else []), f"trainer.total_steps={steps}",
           f"trainer.save_interval={save_interval}", "trainer.save_total_limit=2", *extra]
    if killer_times is not None:
        cmd.append("trainer.max_restarts=1000")
    env = {**os.environ, **ENV, COUNT: str(run.parent / f"{run.name}.scored")}
    if fleet:
        env["RAY_ADDRESS"] = fleet.address
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    killer, active, calls = None, [None], [0]

    def target() -> tuple[str, int] | None:  # the trainer is the supervisor's child (beside its standby, which waits)
        coin, calls[0] = (coins[calls[0]] if calls[0] < len(coins) else False), calls[0] + 1
        if coin:
            pids = fleet.actors()
            return ("actor", pids[calls[0] % len(pids)]) if pids else None
        return ("trainer", active[0]) if active[0] in children(p.pid) else None

    if killer_times is not None:
        killer = Killer(killer_times, target)
        killer.start()
    trained, seen, replayed, tail = [], [], 0, []
    for line in p.stdout:
        tail = (tail + [line])[-20:]
        if m := re.search(r"verlj: training in process (\d+)", line):
            active[0] = int(m.group(1))
        elif m := re.search(r"\[INFO\] Step (\d+): reward=", line):
            trained.append(int(m.group(1)))
            seen.append((time.monotonic(), int(m.group(1))))
        elif m := re.search(r"Replayed steps? (\d+)(?:–(\d+))? from the journal", line):
            replayed += int(m.group(2) or m.group(1)) - int(m.group(1)) + 1
    p.wait()
    wall = time.monotonic() - t0
    if killer:
        killer.stop.set()
    if p.returncode != 0:
        raise SystemExit(f"verlj arm: `{' '.join(cmd[2:6])} …` exited {p.returncode}:\n{''.join(tail)}")
    return {"wall": wall, "failures": killer.landed if killer else Counter(), "lost": len(trained) - len(set(trained)),
            "replayed": replayed, "scored": scored(run), "recovery": to_next_step(killer.when, seen) if killer else []}


def verlj_fingerprints(run: Path) -> dict[int, str]:
    import verlj.engine.schema.events  # noqa: F401 - declares verlj's events: the journal decodes them
    from verlj.journal import open_journal_reader

    with open_journal_reader(run / "journal") as j:
        return {s: j.read_summary(s).first("state")["fingerprint"] for s in range(1, j.last_step() + 1)}


def verlj_arm(root: Path, args, times: list[float], fleet=None, name: str = "verlj", extra: tuple[str, ...] = ()) -> dict:
    name = "fleet" if fleet else name
    coin = random.Random(f"{args.seed}/coins")
    coins = [coin.random() < 0.5 for _ in times] if fleet else []
    verlj_run(root / f"{name}-warmup", 3, args.save_interval, None, fleet, extra=extra)  # untimed: first-time costs (caches, page cache) out of W0
    ref = verlj_run(root / f"{name}-ref", args.steps, args.save_interval, None, fleet, extra=extra)
    got = verlj_run(root / f"{name}-failures", args.steps, args.save_interval, times, fleet, coins, extra)
    prints = verlj_fingerprints(root / f"{name}-ref")
    if prints[1] == prints[args.steps]:
        raise SystemExit(f"{name} arm: the weights did not move in {args.steps} steps (every reward alike?): nothing to compare")
    row = {**got, "w0": ref["wall"], "step": ref["wall"] / args.steps, "identical": prints == verlj_fingerprints(root / f"{name}-failures"),
           "rescored": got["scored"] - ref["scored"]}
    rows = [json.loads(line) for line in (root / f"{name}-ref" / "metrics.jsonl").read_text().splitlines()]
    if any("timing_s/mirror" in r for r in rows):  # the loop's wait for each mirror, over the step it was in
        row["mirror_share"] = statistics.median(r["timing_s/mirror"] / r["timing_s/step"] for r in rows if "timing_s/mirror" in r)
    if fleet:
        from faults import fleet_deaths

        row["deaths"] = fleet_deaths(root / f"{name}-failures")
    return row


def mirror_arm(root: Path, args, times: list[float]) -> dict:
    return verlj_arm(root, args, times, name="mirror", extra=("trainer.mirror_interval=1",))


def fleet_arm(root: Path, args, times: list[float]) -> dict | str:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "skipped: Ray is not installed (pip install -e '.[ray]')"
    from faults import RayCluster

    with RayCluster() as cluster:
        return verlj_arm(root, args, times, cluster)


# ----------------------------------------------------------------------------- TRL

TRL_SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir, out, steps, save_steps, resume, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] or None, float(sys.argv[6])
    bf16 = sys.argv[7:8] == ["bf16"]  # Hugging Face's bf16: fp32 weights and masters, bf16 autocast (tools/bench_scale.py)
    prompts, n, response = {PROMPTS}, {N}, {RESPONSE}
    torch.set_num_threads(1)
    rows = json.load(open(model_dir + "/rows.json"))
    from bench_goodput import counted_add  # verlj's builtin:add, counting its calls (PYTHONPATH: tools/)

    def reward(prompts, completions, answer, **kw):
        return [counted_add(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    class Say(TrainerCallback):  # each line with time.perf_counter() (tools/bench_scale.py: step and save times)
        def on_step_end(self, args, state, control, **kw):
            print(f"TRL STEP {{state.global_step}} {{time.perf_counter()}}", flush=True)

        def on_save(self, args, state, control, **kw):
            print(f"TRL SAVED {{state.global_step}} {{time.perf_counter()}}", flush=True)

    args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=prompts * n, num_generations=n,
                      max_completion_length=response, learning_rate=lr, beta=0.0, save_strategy="steps",
                      save_steps=save_steps, logging_steps=1, report_to="none", use_cpu=True, seed=1,
                      dataloader_num_workers=0, disable_tqdm=True, bf16=bf16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Say()])
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(out + "/final")
''').format(PROMPTS=PROMPTS, N=N, RESPONSE=RESPONSE)


def trl_model_dir(root: Path) -> Path:
    """The verlj arm's initial tiny Llama and tokenizer as a Hugging Face directory, and its prompts."""
    from verlj.engine.config import make_config
    from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm, load_tokenizer

    cfg = make_config(None, MODEL)
    out = root / "trl-model"
    model = load_causal_lm(BUILTIN_TINY, cfg, cfg.trainer.seed)
    tok = load_tokenizer(BUILTIN_TINY, cfg=cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_rows(out, cfg)
    return out


def write_rows(out: Path, cfg) -> None:
    """The run's training prompts and answers as `out`/rows.json, the TRL script's dataset."""
    from verlj.engine.rl.data import load_data

    rows = [{"prompt": e.prompt, "answer": e.answer} for e in load_data(cfg.data, cfg.trainer.seed).train]
    (out / "rows.json").write_text(json.dumps(rows))


def trl_checkpoint(out: Path) -> str:
    """The newest complete checkpoint under `out` ("" when none), removing any newer one a kill tore mid-save.

    Hugging Face's Trainer writes trainer_state.json last (after the weights, optimizer, scheduler and RNG),
    so a checkpoint is complete when that file parses. `resume_from_checkpoint=True` takes the newest
    directory whatever it holds and stops on a torn one; a TRL user deletes it and resumes from the one
    before, which is what this does."""
    steps = sorted((int(d.name.split("-")[1]), d) for d in out.glob("checkpoint-*") if d.name.split("-")[1].isdigit())
    for _, d in reversed(steps):
        try:
            json.loads((d / "trainer_state.json").read_text())
            return str(d)
        except (OSError, ValueError):
            shutil.rmtree(d)
    return ""


def trl_run(py: str, model: Path, out: Path, args, killer_times: list[float] | None) -> dict:
    script = out.parent / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    current: list[subprocess.Popen] = []
    killer = Killer(killer_times, lambda: ("trainer", current[-1].pid) if current and current[-1].poll() is None else None) if killer_times else None
    t0 = time.monotonic()
    if killer:
        killer.start()
    trained: list[int] = []
    seen: list[tuple[float, int]] = []
    while True:
        p = subprocess.Popen([py, str(script), str(model), str(out), str(args.steps), str(args.trl_save_steps), trl_checkpoint(out),
                              str(LR)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **ENV, COUNT: str(out.parent / f"{out.name}.scored")})
        current.append(p)
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            if m := re.match(r"TRL STEP (\d+)", line):
                trained.append(int(m.group(1)))
                seen.append((time.monotonic(), int(m.group(1))))
        if p.wait() == 0:
            break
        if p.returncode != -signal.SIGKILL:
            raise SystemExit(f"trl arm: the TRL script exited {p.returncode}:\n{''.join(tail)}")
    if killer:
        killer.stop.set()
    return {"wall": time.monotonic() - t0, "failures": killer.landed if killer else Counter(), "lost": len(trained) - len(set(trained)),
            "scored": scored(out), "recovery": to_next_step(killer.when, seen) if killer else []}


def trl_weights_equal(a: Path, b: Path) -> bool:
    """Whether two model directories (a run's `final`, or the initial model) hold the same weights, bit for bit."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def trl_arm(root: Path, args, times: list[float]) -> dict | str:
    probe = subprocess.run([args.trl_python, "-c", "import trl, verlj.engine; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"skipped: TRL (or verlj, for the reward) cannot be imported by {args.trl_python} (pip install trl, or --trl-python)"
    model = trl_model_dir(root)
    for name in ("trl-warmup", "trl-ref", "trl-failures"):
        (root / name).mkdir()
    trl_run(args.trl_python, model, root / "trl-warmup" / "out", argparse.Namespace(**{**vars(args), "steps": 3}), None)  # untimed
    ref = trl_run(args.trl_python, model, root / "trl-ref" / "out", args, None)
    if trl_weights_equal(model, root / "trl-ref" / "out" / "final"):
        raise SystemExit(f"trl arm: the weights did not move in {args.steps} steps (every reward alike?): nothing to compare")
    got = trl_run(args.trl_python, model, root / "trl-failures" / "out", args, times)
    return {**got, "w0": ref["wall"], "step": ref["wall"] / args.steps, "identical": trl_weights_equal(root / "trl-ref" / "out" / "final", root / "trl-failures" / "out" / "final"),
            "rescored": got["scored"] - ref["scored"], "version": probe.stdout.strip()}


# ----------------------------------------------------------------------------- main


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def row_line(arm: str, r: dict | str) -> str:
    if isinstance(r, str):
        return f"{arm:<6} {r}"
    kills = sum(r["failures"].values())
    what = f"{kills} ({r['failures']['trainer']}/{r['failures']['actor']})" if arm == "fleet" else str(kills)
    rec = f"{sum(r['recovery']) / len(r['recovery']):.1f}" if r["recovery"] else "-"
    return (f"{arm:<6} {r['w0']:>6.0f} {r['wall']:>6.0f} {r['w0'] / r['wall']:>8.2f} {what:>15} {rec:>10} {r['step']:>7.2f} {r['lost']:>11} "
            f"{r.get('replayed', '-'):>9} {r['rescored']:>9}  {'yes' if r['identical'] else 'no'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="200", help="steps of every arm (200), or per arm: verlj=3000,fleet=2000,trl=600")
    ap.add_argument("--mtbf", type=float, default=60.0, help="mean time between failures, seconds")
    ap.add_argument("--seed", type=int, default=0, help="the failure schedule's seed")
    ap.add_argument("--save-interval", type=int, default=10, help="verlj: trainer.save_interval")
    ap.add_argument("--trl-save-steps", type=int, default=10, help="TRL: save_steps")
    ap.add_argument("--arms", default="verlj,mirror,fleet,trl")
    ap.add_argument("--trl-python", default=sys.executable)
    args = ap.parse_args()
    arms = {"verlj": verlj_arm, "mirror": mirror_arm, "fleet": fleet_arm, "trl": trl_arm}
    if bad := [a for a in args.arms.split(",") if a not in arms]:
        ap.error(f"--arms: {', '.join(bad)} is not one of {', '.join(arms)}")
    try:
        steps = {a: int(args.steps) for a in arms} if "=" not in args.steps else {a: int(n) for a, n in (x.split("=") for x in args.steps.split(","))}
    except ValueError:
        ap.error(f"--steps: a number of steps, or arm=steps,... (got {args.steps!r})")
    times = schedule(args.seed, args.mtbf, horizon=100 * args.mtbf)
    root = Path(tempfile.mkdtemp(prefix="verlj-goodput-"))
    rows = {}
    try:
        for arm in args.arms.split(","):
            t0 = time.monotonic()
            if arm not in steps:
                ap.error(f"--steps names no steps for the {arm} arm")
            rows[arm] = arms[arm](root, argparse.Namespace(**{**vars(args), "steps": steps[arm]}), times)
            print(f"  {arm}: done in {time.monotonic() - t0:.0f} s: {row_line(arm, rows[arm])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nsteps {', '.join(f'{a} {steps[a]}' for a in rows)}; failures every {args.mtbf:g} s on average (seed {args.seed}), {os.cpu_count()} cores; "
          f"verlj snapshots every {args.save_interval} steps, TRL checkpoints every {args.trl_save_steps}")
    print(f"{'arm':<6} {'W0 s':>6} {'W s':>6} {'goodput':>8} {'failures':>15} {'to next s':>10} {'step s':>7} {'steps lost':>11} "
          f"{'replayed':>9} {'rescored':>9}  identical")
    for arm, r in rows.items():
        print(row_line(arm, r))
    done = {a: r for a, r in rows.items() if not isinstance(r, str)}
    if "fleet" in done:
        print(f"fleet: failures trainer/actor; {done['fleet']['deaths']} actor deaths counted by the fleet (rollout/fleet/deaths)")
    if "trl" in done:
        print(f"trl: TRL {done['trl']['version']}")
    if any(sum(r["failures"].values()) < 10 for r in done.values()):
        print("warning: fewer than 10 failures landed in an arm: its goodput says little (raise --steps or lower --mtbf)")
    if "verlj" in done and "mirror" in done:
        print(f"mirror / verlj: W0 {done['mirror']['w0'] / done['verlj']['w0']:.3f} (what mirroring every step costs), "
              f"to the next new step {_mean(done['mirror']['recovery']) / _mean(done['verlj']['recovery']):.2f}; the loop held by each "
              f"mirror (timing_s/mirror) {done['mirror'].get('mirror_share', float('nan')):.1%} of its step (median)")
    for a in ("verlj", "mirror", "fleet"):
        if a in done and "trl" in done:
            print(f"goodput {a} / TRL: {(done[a]['w0'] / done[a]['wall']) / (done['trl']['w0'] / done['trl']['wall']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
