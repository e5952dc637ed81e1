"""AdamW's step, side by side in one process: torch's fused kernel (``model.actor.optim.fused: true``, a new
run's default and what Hugging Face's Trainer picks) against torch's default (a tensor at a time on CPU:
what runs made before the key step with).

    python tools/bench_adamw.py                    # a Llama-like set of about 179M parameters, fp32, one thread (~1 min)
    python tools/bench_adamw.py --params 20e6 --threads 2

The parameters are shaped like a model's (tools/bench_fingerprint.py's set) with random gradients; each arm
steps its own copy (the moments made by a first, untimed step), the two interleaved, --repeats times; prints
the median seconds a step and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_fingerprint import state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=135e6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [t.shape for path, t in state(int(args.params), "cpu") if path.startswith("param/")]
    g = torch.Generator().manual_seed(0)
    arms = {}
    for name, fused in (("per-tensor", None), ("fused", True)):
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=fused)
        opt.step()  # the moments made
        arms[name] = (opt, [])
    n = sum(s.numel() for s in shapes)
    for _ in range(args.repeats):
        for opt, times in arms.values():
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    med = {name: statistics.median(times) for name, (_, times) in arms.items()}
    print(f"AdamW on {n / 1e6:.1f}M fp32 parameters, {args.threads} thread(s), median of {args.repeats}:")
    for name, s in med.items():
        print(f"  {name:10s} {s:.3f} s a step   {n * 16 / s / 1e9:.1f} GB/s of state")
    print(f"  fused / per-tensor: {med['fused'] / med['per-tensor']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
