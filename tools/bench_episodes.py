"""Episode benchmark: turns per second and journal bytes per turn for rollout.env's episodes on verlj's own
sampler (rollout.engine=hf), a colocated vLLM engine and a Ray fleet of two actors, side by side.

    python tools/bench_episodes.py                         # builtin:guess, 8 prompts x 4 episodes x 3 turns, 6 steps
    python tools/bench_episodes.py --steps 10 --arms hf,fleet

Each arm is one `verlj train` of the same GRPO job (its own process, one thread): `hf` and `vllm` in sync
mode, `fleet` in async step order on two actors (a local Ray cluster the run starts; the envs run on the
actors, beside generation). From each run's journal: the turns its episodes took (every action, all
steps after the first), the step time of those steps (the first holds vLLM's and Ray's start-up), and the
bytes of their records (what the journal stores a step, samples compressed). Prints turns/s and bytes a
turn for each arm and the ratios against `hf`. The machine's load average and cores are printed with
them: on a shared machine the times mean little, the ratios a little more, the bytes are exact.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "hf": [],
    "vllm": ["rollout.engine=vllm"],
    "fleet": ["rollout.mode=async", "rollout.fleet=ray", "rollout.fleet_size=2"],
}


def job(args) -> list[str]:
    return ["model.tiny.num_heads=2", "model.tiny.vocab=ascii", f"rollout.env={args.env}", f"rollout.max_turns={args.turns}",
            f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}", f"rollout.max_response_length={args.response_length}",
            f"trainer.total_steps={args.steps}", f"trainer.save_interval={args.steps}", "logging.progress=off",
            f"model.actor.micro_batch_size={args.prompts * args.n}", f"model.critic.micro_batch_size={args.prompts * args.n}"]


def run(arm: str, root: Path, args) -> dict:
    out = root / arm
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    t = time.perf_counter()
    got = subprocess.run([sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(out), *job(args), *ARMS[arm]],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if got.returncode != 0:
        raise SystemExit(f"{arm}: verlj train exited {got.returncode}: {got.stderr.strip().splitlines()[-1:]}")
    from verlj.engine.schema.events import StepEvents
    from verlj.engine.schema.sample import unpack
    from verlj.journal import open_journal_reader

    turns = secs = size = 0.0
    with open_journal_reader(out / "journal") as j:
        for rec in j.iter_steps():
            if rec.step == 1:  # start-up: vLLM's engine, Ray's cluster and actors
                continue
            ev = StepEvents.of(rec)
            turns += sum(len(s.turn_lens) // 2 for s in unpack(ev.added.samples))
            secs += ev.metrics.values["timing_s/step"]
            size += len(j.read_raw(rec.step))
    return {"turns": turns, "seconds": secs, "bytes": size, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="hf,vllm,fleet")
    ap.add_argument("--env", default="builtin:guess")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    arms = args.arms.split(",")
    print(f"{args.env}, {args.prompts} prompts x {args.n} episodes x up to {args.turns} turns of {args.response_length} tokens, "
          f"{args.steps} steps (the first not counted); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    got = {}
    with tempfile.TemporaryDirectory(prefix="verlj-bench-episodes-") as tmp:
        for arm in arms:
            got[arm] = r = run(arm, Path(tmp), args)
            print(f"{arm:>6}: {r['turns']:.0f} turns in {r['seconds']:.2f} s of steps: {r['turns'] / r['seconds']:.1f} turns/s, "
                  f"{r['bytes'] / r['turns']:.0f} journal bytes a turn (run {r['wall']:.0f} s)", flush=True)
    base = got.get("hf")
    if base is not None:
        for arm in arms[1:] if arms[0] == "hf" else arms:
            r = got[arm]
            print(f"{arm} / hf: turns/s {(r['turns'] / r['seconds']) / (base['turns'] / base['seconds']):.2f}x, "
                  f"bytes a turn {(r['bytes'] / r['turns']) / (base['bytes'] / base['turns']):.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
