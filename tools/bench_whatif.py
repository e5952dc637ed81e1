"""A what-if against live training, side by side: the same 40 steps, trained live (generating) and
re-trained by `verlj whatif` on the journaled samples (generating nothing).

    python tools/bench_whatif.py                    # 40 steps, 64-token responses (ignore_eos), a few minutes on CPU
    python tools/bench_whatif.py --steps 10 --response-length 32

Trains a run of steps + 1 steps, then a what-if of it from step 1 (another learning rate, so its
states part from the run's at once and its off-policy correction is on: the case a what-if is for)
over the same steps 2..steps+1. Prints the median and total step time of each, their ratio (goal
<= 0.6x), generation's share of the live step, and the what-if command's whole wall time (the
replay to step 1 and the start included).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def step_times(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--response-length", type=int, default=64)
    args = ap.parse_args()

    from verlj.engine.loop.run import train
    from verlj.engine.post_mortem.counterfactual import whatif

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-whatif-"))
    overrides = [
        f"trainer.total_steps={args.steps + 1}", "trainer.save_interval=0",
        f"rollout.max_response_length={args.response_length}", "rollout.ignore_eos=true",
        "data.max_prompt_length=16", "data.prompts_per_step=8", "rollout.n=8",
        "model.tiny.hidden_size=128", "model.tiny.num_layers=4", "model.tiny.intermediate_size=256",
        "logging.progress=off",
    ]
    try:
        run, new = root / "run", root / "whatif"
        train(run, None, overrides)
        t = time.perf_counter()
        whatif(run, 1, None, new, ["model.actor.optim.lr=5e-4"])
        wall = time.perf_counter() - t
        live, cf = step_times(run), step_times(new)
        steps = range(2, args.steps + 2)
        cost = lambda r: r["timing_s/step"] + r.get("timing_s/commit", 0.0)  # noqa: E731
        live_s, cf_s = [cost(live[s]) for s in steps], [cost(cf[s]) for s in steps]
        gen = sum(live[s].get("timing_s/gen", 0.0) for s in steps) / sum(live_s)
        print(f"{args.steps} steps (2..{args.steps + 1}), 64 samples/step x {args.response_length} tokens")
        print(f"  live     median step {statistics.median(live_s) * 1e3:8.1f} ms, total {sum(live_s):7.2f} s "
              f"(generation {gen:.1%} of it)")
        print(f"  what-if  median step {statistics.median(cf_s) * 1e3:8.1f} ms, total {sum(cf_s):7.2f} s "
              f"(the whole command {wall:.2f} s, replay to step 1 and start included)")
        print(f"  ratio    {sum(cf_s) / sum(live_s):.2f}x the live steps' time (goal <= 0.6x); "
              f"median {statistics.median(cf_s) / statistics.median(live_s):.2f}x")
        drift = [cf[s].get("whatif/drift/mean") for s in steps]
        print(f"  drift    whatif/drift/mean {drift[0]:.3g} at step 2 -> {drift[-1]:.3g} at step {args.steps + 1}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
