"""Goodput under failures: the same job, the same seeded failure schedule, each arm restarted by itself.

    python tools/bench_goodput.py                                  # verlj and TRL, mean time between failures 60 s
    python tools/bench_goodput.py --mtbf 20 --steps 60 --arms verlj
    python tools/bench_goodput.py --trl-python /path/to/venv/bin/python   # TRL from another environment

Each arm trains the built-in addition task on the same tiny Llama (4 layers, 256 wide, 32-token
responses, 4 prompts x 4 samples a step) for 3 untimed warm-up steps, then for --steps steps, twice: once without failures (its
reference: wall time W0, final state), once under the failure schedule (wall time W): SIGKILLs of
the training process at times drawn once from --seed (exponential gaps, mean --mtbf seconds, the
same times for every arm), each followed by an automatic restart. It prints, per arm:

  goodput       W0 / W: the share of the wall time that went to training the steps once
  failures      SIGKILLs that landed
  steps lost    steps trained to the end again after a restart (generation, scoring and update redone)
  replayed      steps re-applied from verlj's journal after a restart (the update only: no generation)
  identical     whether the run under failures ends in the reference's state, bit for bit

Arms:
  verlj   `verlj train … trainer.max_restarts=1000`: the process you start supervises the trainer and
          restarts it with --resume (the journal holds every committed step; the newest snapshot is
          loaded and the journal replayed, no generation); identical = every step's fingerprint equal.
  trl     TRL's GRPOTrainer (save_steps --trl-save-steps, as TRL users checkpoint), restarted by this
          driver with resume_from_checkpoint from its newest checkpoint; identical = the final
          weights equal. Skipped with one line when TRL cannot be imported by --trl-python.
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
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS, N, RESPONSE, LR = 4, 4, 32, 1e-3
MODEL = ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.intermediate_size=512", "data.max_prompt_length=16",
         f"rollout.max_response_length={RESPONSE}", "rollout.ignore_eos=true", f"data.prompts_per_step={PROMPTS}", f"rollout.n={N}",
         f"model.actor.micro_batch_size={PROMPTS * N}", f"model.actor.optim.lr={LR}", "logging.progress=lines"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}


def schedule(seed: int, mtbf: float, horizon: float) -> list[float]:
    """Failure times (seconds from an arm's start), the same for every arm."""
    rng, t, out = random.Random(seed), 0.0, []
    while t < horizon:
        t += rng.expovariate(1.0 / mtbf)
        out.append(t)
    return out


class Killer:
    """SIGKILLs `target()` (a pid, or None while there is none) at each scheduled time from start()."""

    def __init__(self, times: list[float], target):
        self.times, self.target, self.landed = times, target, 0
        self.stop = threading.Event()

    def start(self) -> None:
        t0 = time.monotonic()

        def loop():
            for t in self.times:
                if self.stop.wait(max(0.0, t0 + t - time.monotonic())):
                    return
                pid = self.target()
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.landed += 1
                    except ProcessLookupError:
                        pass

        threading.Thread(target=loop, daemon=True).start()


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# ----------------------------------------------------------------------------- verlj


def verlj_run(run: Path, steps: int, save_interval: int, killer_times: list[float] | None) -> dict:
    cmd = [sys.executable, "-m", "verlj.cli", "train", "-o", str(run), *MODEL, f"trainer.total_steps={steps}",
           f"trainer.save_interval={save_interval}", "trainer.save_total_limit=2"]
    if killer_times is not None:
        cmd.append("trainer.max_restarts=1000")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV}, cwd=REPO)
    killer, active = None, [None]
    if killer_times is not None:  # the trainer is the supervisor's child (beside its standby, which waits)
        killer = Killer(killer_times, lambda: active[0] if active[0] in children(p.pid) else None)
        killer.start()
    trained, replayed = [], 0
    for line in p.stdout:
        if m := re.search(r"verlj: training in process (\d+)", line):
            active[0] = int(m.group(1))
        elif m := re.search(r"\[INFO\] Step (\d+): reward=", line):
            trained.append(int(m.group(1)))
        elif m := re.search(r"Replayed steps? (\d+)(?:–(\d+))? from the journal", line):
            replayed += int(m.group(2) or m.group(1)) - int(m.group(1)) + 1
    p.wait()
    wall = time.monotonic() - t0
    if killer:
        killer.stop.set()
    if p.returncode != 0:
        raise SystemExit(f"verlj arm: `{' '.join(cmd[2:6])} …` exited {p.returncode}")
    return {"wall": wall, "failures": killer.landed if killer else 0, "lost": len(trained) - len(set(trained)), "replayed": replayed}


def verlj_fingerprints(run: Path) -> dict[int, str]:
    from verlj.journal import open_journal_reader

    with open_journal_reader(run / "journal") as j:
        return {s: j.read_summary(s).first("state")["fingerprint"] for s in range(1, j.last_step() + 1)}


def verlj_arm(root: Path, args, times: list[float]) -> dict:
    verlj_run(root / "verlj-warmup", 3, args.save_interval, None)  # untimed: first-time costs (caches, page cache) out of W0
    ref = verlj_run(root / "verlj-ref", args.steps, args.save_interval, None)
    got = verlj_run(root / "verlj-failures", args.steps, args.save_interval, times)
    return {**got, "w0": ref["wall"], "identical": verlj_fingerprints(root / "verlj-ref") == verlj_fingerprints(root / "verlj-failures")}


# ----------------------------------------------------------------------------- TRL

TRL_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir, out, steps, save_steps, resume, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", float(sys.argv[6])
    prompts, n, response = {PROMPTS}, {N}, {RESPONSE}
    torch.set_num_threads(1)
    rows = json.load(open(model_dir + "/rows.json"))
    score = lambda r, a: 1.0 if r.strip() == a else 0.0  # exact answers (verlj's builtin:add also gives partial credit)

    def reward(prompts, completions, answer, **kw):
        return [score(c, a) for c, a in zip(completions, answer)]

    class Say(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            print(f"TRL STEP {{state.global_step}}", flush=True)

    args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=prompts * n, num_generations=n,
                      max_completion_length=response, learning_rate=lr, beta=0.0, save_strategy="steps",
                      save_steps=save_steps, logging_steps=1, report_to="none", use_cpu=True, seed=1,
                      dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Say()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(out + "/final")
''').format(PROMPTS=PROMPTS, N=N, RESPONSE=RESPONSE)


def trl_model_dir(root: Path) -> Path:
    """The verlj arm's initial tiny Llama and tokenizer as a Hugging Face directory, and its prompts."""
    from verlj.engine.config import make_config
    from verlj.engine.rl.data import load_data
    from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm, load_tokenizer

    cfg = make_config(None, MODEL)
    out = root / "trl-model"
    model = load_causal_lm(BUILTIN_TINY, cfg, cfg.trainer.seed)
    tok = load_tokenizer(BUILTIN_TINY, cfg=cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    rows = [{"prompt": e.prompt, "answer": e.answer} for e in load_data(cfg.data, cfg.trainer.seed).train]
    (out / "rows.json").write_text(json.dumps(rows))
    return out


def trl_run(py: str, model: Path, out: Path, args, killer_times: list[float] | None) -> dict:
    script = out.parent / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    current: list[subprocess.Popen] = []
    killer = Killer(killer_times, lambda: current[-1].pid if current and current[-1].poll() is None else None) if killer_times else None
    t0 = time.monotonic()
    if killer:
        killer.start()
    trained: list[int] = []
    while True:
        resume = any(out.glob("checkpoint-*"))
        p = subprocess.Popen([py, str(script), str(model), str(out), str(args.steps), str(args.trl_save_steps), "1" if resume else "0",
                              str(LR)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
        current.append(p)
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            if m := re.match(r"TRL STEP (\d+)", line):
                trained.append(int(m.group(1)))
        if p.wait() == 0:
            break
        if p.returncode != -signal.SIGKILL:
            raise SystemExit(f"trl arm: the TRL script exited {p.returncode}:\n{''.join(tail)}")
    if killer:
        killer.stop.set()
    return {"wall": time.monotonic() - t0, "failures": killer.landed if killer else 0, "lost": len(trained) - len(set(trained))}


def trl_weights_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def trl_arm(root: Path, args, times: list[float]) -> dict | str:
    probe = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"skipped: TRL cannot be imported by {args.trl_python} (pip install trl, or --trl-python)"
    model = trl_model_dir(root)
    for name in ("trl-warmup", "trl-ref", "trl-failures"):
        (root / name).mkdir()
    trl_run(args.trl_python, model, root / "trl-warmup" / "out", argparse.Namespace(**{**vars(args), "steps": 3}), None)  # untimed
    ref = trl_run(args.trl_python, model, root / "trl-ref" / "out", args, None)
    got = trl_run(args.trl_python, model, root / "trl-failures" / "out", args, times)
    return {**got, "w0": ref["wall"], "identical": trl_weights_equal(root / "trl-ref" / "out", root / "trl-failures" / "out"),
            "version": probe.stdout.strip()}


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mtbf", type=float, default=60.0, help="mean time between failures, seconds")
    ap.add_argument("--seed", type=int, default=0, help="the failure schedule's seed")
    ap.add_argument("--save-interval", type=int, default=10, help="verlj: trainer.save_interval")
    ap.add_argument("--trl-save-steps", type=int, default=10, help="TRL: save_steps")
    ap.add_argument("--arms", default="verlj,trl")
    ap.add_argument("--trl-python", default=sys.executable)
    args = ap.parse_args()
    times = schedule(args.seed, args.mtbf, horizon=100 * args.mtbf)
    root = Path(tempfile.mkdtemp(prefix="verlj-goodput-"))
    rows = {}
    try:
        for arm in args.arms.split(","):
            t0 = time.monotonic()
            rows[arm] = {"verlj": verlj_arm, "trl": trl_arm}[arm](root, args, times)
            print(f"  {arm}: done in {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.steps} steps, failures every {args.mtbf:g} s on average (seed {args.seed}), {os.cpu_count()} cores; "
          f"verlj snapshots every {args.save_interval} steps, TRL checkpoints every {args.trl_save_steps}")
    print(f"{'arm':<8} {'W0 s':>7} {'W s':>7} {'goodput':>8} {'failures':>9} {'steps lost':>11} {'replayed':>9}  identical")
    for arm, r in rows.items():
        if isinstance(r, str):
            print(f"{arm:<8} {r}")
            continue
        print(f"{arm:<8} {r['w0']:>7.0f} {r['wall']:>7.0f} {r['w0'] / r['wall']:>8.2f} {r['failures']:>9} {r['lost']:>11} "
              f"{r.get('replayed', '-'):>9}  "
              f"{'yes' if r['identical'] else 'no'}")
    done = [r for r in rows.values() if not isinstance(r, str)]
    if any(r["failures"] < 10 for r in done):
        print("warning: fewer than 10 failures landed in an arm: its goodput says little (raise --steps or lower --mtbf)")
    if "verlj" in rows and "trl" in rows and len(done) == 2:
        print(f"goodput verlj / TRL: {(rows['verlj']['w0'] / rows['verlj']['wall']) / (rows['trl']['w0'] / rows['trl']['wall']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
