"""Where a training step's time goes, on one run: generation, reward, update, journal commit.

    python tools/bench_train.py                 # 30 steps, 64-token responses (ignore_eos), ~1-2 min
    python tools/bench_train.py --steps 10 --algo ppo
    python tools/bench_train.py --ship           # also the same run with journal.local_dir, side by side

Prints each part's share of the step time (median over steps after the first, which warms up),
the journal commit's share (goal < 1%), the stage digests' share (goal <= 1%), bytes journaled per
step, and the run's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
from pathlib import Path

PARTS = {
    "generation": ["timing_s/gen"],
    "reward": ["timing_s/reward"],
    "log-probs (old, ref), values": ["timing_s/old_log_prob", "timing_s/ref", "timing_s/values"],
    "advantages": ["timing_s/adv"],
    "update (actor, critic)": ["timing_s/update_actor", "timing_s/update_critic"],
    "fingerprint": ["timing_s/fingerprint"],
}
# the stage digests (state.stages): their own share, partly spent inside the update (the gradients')
STAGES = "timing_s/stages"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--algo", default="grpo", choices=["grpo", "ppo"])
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--ship", action="store_true", help="also run with journal.local_dir and compare step times")
    args = ap.parse_args()

    from verlj.engine.loop.run import train

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-train-"))
    overrides = [
        f"trainer.total_steps={args.steps}", "trainer.save_interval=0", f"algorithm.name={args.algo}",
        f"rollout.max_response_length={args.response_length}", "rollout.ignore_eos=true",
        "data.max_prompt_length=16", "data.prompts_per_step=8", "rollout.n=8",
        "model.tiny.hidden_size=128", "model.tiny.num_layers=4", "model.tiny.intermediate_size=256",
        "logging.progress=off",
    ]
    try:
        run = root / "run"
        train(run, None, overrides)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
        step = statistics.median(r["timing_s/step"] + r["timing_s/commit"] for r in rows)
        print(f"{args.algo}, {len(rows)} steps measured (first skipped), 64 samples/step x {args.response_length} tokens, "
              f"median step {step * 1e3:.1f} ms")
        accounted = 0.0
        for name, keys in PARTS.items():
            t = statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)
            accounted += t
            print(f"  {name:32s} {t / step:6.1%}")
        commit = statistics.median(r["timing_s/commit"] for r in rows)
        print(f"  {'journal commit':32s} {commit / step:6.2%}   (goal < 1%; {commit * 1e3:.2f} ms)")
        stages = statistics.median(r.get(STAGES, 0.0) for r in rows)
        print(f"  {'stage digests':32s} {stages / step:6.2%}   (goal <= 1%; {stages * 1e3:.2f} ms, the gradients' inside the update)")
        print(f"  {'other (collect plumbing, buffer)':32s} {max(0.0, 1 - (accounted + commit) / step):6.1%}")
        size = sum(p.stat().st_size for p in (run / "journal").glob("*.mdb"))
        print(f"journal: {size / args.steps / 1024:.1f} KiB per step on disk")
        print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        if args.ship:
            compare_shipping(train, root, overrides, rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare_shipping(train, root: Path, overrides: list[str], plain_rows: list[dict]) -> None:
    """The same run with journal.local_dir (ship_max_lag_steps=2), then plain again: shipping's cost per step."""
    runs = {"plain": plain_rows}
    for name, extra in (("shipped", [f"journal.local_dir={root / 'local'}"]), ("plain again", [])):
        run = root / name.replace(" ", "-")
        train(run, None, [*overrides, *extra])
        runs[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    med = {k: statistics.median(r["timing_s/step"] + r["timing_s/commit"] for r in rows) for k, rows in runs.items()}
    base = (med["plain"] + med["plain again"]) / 2
    lag = max(r.get("journal/ship_lag_steps", 0) for r in runs["shipped"])
    cpu = statistics.median(r.get("timing_s/ship_cpu", 0.0) for r in runs["shipped"])
    print("journal.local_dir (shipping to the run directory), same run side by side:")
    for k, v in med.items():
        print(f"  median step, {k:12s} {v * 1e3:8.1f} ms")
    print(f"  shipping's extra cost   {(med['shipped'] - base) / base:+7.2%} of the step (goal <= 1%; "
          f"plain vs plain again differ by {abs(med['plain'] - med['plain again']) / base:.2%}: the noise)")
    print(f"  the shipper's own CPU   {cpu / med['shipped']:7.2%} of the step ({cpu * 1e3:.2f} ms a step, median; what it can take from training)")
    print(f"  largest ship lag        {lag} step(s)")


if __name__ == "__main__":
    main()
