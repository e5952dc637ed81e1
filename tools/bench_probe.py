"""Hindsight metrics over past steps: `verlj replay --steps A:B --probe` with --workers 1 and 2, side by side.

    python tools/bench_probe.py              # 40 steps, snapshots every 20; ~5 min on 2 cores
    python tools/bench_probe.py --steps 20 --save-interval 10

Trains one run (the built-in model, 4 layers of width 256, 64 samples x 64 tokens a step), then measures its steps 1..N with a
probe that does a forward pass per step (the policy's mean entropy on the batch), twice with one
worker and twice with two, alternating, through the real CLI. Prints the wall times, the speed-up
of two workers (goal on this 2-core machine: >= 1.6; the range splits at the middle snapshot, so
each worker replays half), that both give the same numbers, and the stage digests' share of a
training step (goal <= 1%).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = '''
import torch

def entropy(step, batch, model):
    """The policy's mean token entropy over the responses the step trains on (one forward pass)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in batch[:16]:
            ids = torch.tensor([list(s["prompt_ids"]) + list(s["response_ids"])])
            logits = model(ids).logits[0, len(s["prompt_ids"]) - 1:-1].float()
            p = torch.log_softmax(logits, -1)
            total += float(-(p.exp() * p).sum(-1).sum())
            count += logits.shape[0]
    return {"entropy": total / max(count, 1)}
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-interval", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256, help="the built-in model's width (4 layers)")
    ap.add_argument("--response-length", type=int, default=64)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-probe-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    (root / "bench_probe_fn.py").write_text(PROBE)
    run = root / "run"
    overrides = [
        f"trainer.total_steps={args.steps}", f"trainer.save_interval={args.save_interval}", "trainer.save_total_limit=0",
        f"rollout.max_response_length={args.response_length}", "rollout.ignore_eos=true", "data.max_prompt_length=16",
        "data.prompts_per_step=8", "rollout.n=8", f"model.tiny.hidden_size={args.hidden}", "model.tiny.num_layers=4",
        f"model.tiny.intermediate_size={2 * args.hidden}",
        "logging.progress=off",
    ]
    try:
        subprocess.run([sys.executable, "-m", "verlj.cli", "train", "-o", str(run), *overrides], check=True, env=env, cwd=REPO,
                       capture_output=True)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
        share = statistics.median(r["timing_s/stages"] / (r["timing_s/step"] + r["timing_s/commit"]) for r in rows)
        times: dict[int, list[float]] = {1: [], 2: []}
        outputs: dict[int, str] = {}
        for workers in (1, 2, 2, 1):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "verlj.cli", "replay", str(run), "--steps", f"1:{args.steps}",
                                  "--probe", "bench_probe_fn:entropy", "--workers", str(workers)],
                                 check=True, env=env, cwd=REPO, capture_output=True, text=True)
            times[workers].append(time.perf_counter() - t)
            outputs[workers] = out.stdout
        one, two = statistics.median(times[1]), statistics.median(times[2])
        print(f"probe (one forward pass a step) over steps 1-{args.steps}, snapshots every {args.save_interval}, "
              f"launch to exit through the CLI:")
        print(f"  --workers 1   {one:6.1f} s   ({', '.join(f'{x:.1f}' for x in times[1])})")
        print(f"  --workers 2   {two:6.1f} s   ({', '.join(f'{x:.1f}' for x in times[2])})")
        print(f"  speed-up      {one / two:.2f}x   (goal >= 1.6)")
        print(f"  same numbers: {'yes' if outputs[1] == outputs[2] else 'NO'}")
        print(f"stage digests: {share * 100:.2f}% of a training step (median over {len(rows)} steps; goal <= 1%)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
