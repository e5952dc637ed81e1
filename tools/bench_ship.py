"""Journal shipping (journal.local_dir): its throughput, its lag, and what it costs the step loop.

    python tools/bench_ship.py                   # ~1 min
    python tools/bench_ship.py --steps 200 --samples 64 --tokens 256

Side by side, in one process, on the same records:

1. throughput: shipping N committed steps as segments vs the floor, a plain write + fsync + rename
   of the same bytes (the records as LMDB stores them);
2. lag under a step loop that only commits (no compute at all), with ship_max_lag_steps=2: how
   far the shipper falls behind, and how much of the loop's time was spent waiting for it;
3. the loop's cost: a loop of compute (a fixed matrix product) + commit, without shipping and with
   it; the difference as a share of the step (goal: <= 1%). `tools/bench_train.py --ship` measures
   the same on real training steps.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import verlj.engine  # noqa: F401  (declares verlj's event types to the journal)
from verlj.journal import Journal, make_event, segments
from verlj.journal.durable import replace_durably
from verlj.journal.shipper import Shipper


def step_events(step: int, samples: int, tokens: int) -> list[dict]:
    rng = np.random.default_rng(step)
    return [
        make_event("buffer.add", ids=rng.integers(0, 32_000, size=(samples, tokens), dtype=np.int64),
                   logprobs=rng.standard_normal((samples, tokens)).astype(np.float32),
                   rewards=rng.standard_normal(samples)),
        make_event("metrics", values={"actor/pg_loss": 0.1, "critic/score/mean": 0.5}),
        make_event("state", fingerprint=f"{step:064x}"),
    ]


def throughput(root: Path, events: list[list[dict]]) -> None:
    local = root / "t-local"
    with Journal.open_writer(local) as j:
        for s, ev in enumerate(events, 1):
            j.writer.append_step(s, ev)
        frames = [raw for _s, raw in j.iter_raw()]
    size = sum(map(len, frames))
    best_ship = best_copy = float("inf")
    for rep in range(3):
        shipped = root / f"t-run{rep}" / "journal"
        with Journal.open_writer(local) as j:
            t0 = time.perf_counter()
            shipper = Shipper(j, shipped, max_lag=10**9)
            shipper.close()  # ships everything committed, then stops
            best_ship = min(best_ship, time.perf_counter() - t0)
        d = root / f"t-copy{rep}"
        d.mkdir()
        t0 = time.perf_counter()
        replace_durably(d / "copy", frames, tmp=d / ".tmp")
        best_copy = min(best_copy, time.perf_counter() - t0)
    mib = size / 2**20
    print(f"1. throughput, {len(frames)} steps, {mib:.1f} MiB (best of 3)")
    print(f"   shipped as segments    {mib / best_ship:8.1f} MiB/s")
    print(f"   write + fsync floor    {mib / best_copy:8.1f} MiB/s")
    print(f"   ratio                  {best_ship / best_copy:8.2f}x the floor's time")


def lag(root: Path, events: list[list[dict]], max_lag: int) -> None:
    j, _ = segments.open_writer(root / "l-local", root / "l-run" / "journal", max_lag)
    lags, waits = [], 0.0
    t_loop = time.perf_counter()
    with j:
        for s, ev in enumerate(events, 1):
            t0 = time.perf_counter()
            j.writer.append_step(s, ev)
            waits += time.perf_counter() - t0
            lags.append(j.shipping.shipper.lag())
        t_loop = time.perf_counter() - t_loop
    print(f"2. lag, commit-only loop ({len(events)} steps, ship_max_lag_steps={max_lag})")
    print(f"   lag after a commit     mean {statistics.mean(lags):.2f}, max {max(lags)} steps")
    print(f"   loop time in commit    {waits / t_loop:6.1%} (append + fsync + waiting for the shipper)")


def loop_cost(root: Path, events: list[list[dict]], compute: int, rounds: int) -> None:
    a = np.random.default_rng(0).standard_normal((compute, compute))

    def run(name: str, ship: bool) -> list[float]:
        if ship:
            j, _ = segments.open_writer(root / f"c-{name}", root / f"c-{name}-run" / "journal", 2)
        else:
            j = Journal.open_writer(root / f"c-{name}")
        times = []
        with j:
            for s, ev in enumerate(events, 1):
                t0 = time.perf_counter()
                (a @ a).sum()  # the step's work
                j.writer.append_step(s, ev)
                times.append(time.perf_counter() - t0)
        return times

    plain, shipped = [], []
    for r in range(rounds):  # interleaved, so drift on a noisy machine hits both alike
        plain += run(f"plain{r}", False)
        shipped += run(f"ship{r}", True)
    mp, ms = statistics.median(plain), statistics.median(shipped)
    print(f"3. loop cost: compute ({compute}x{compute} matmul) + commit, {len(events)} steps x {rounds} rounds each")
    print(f"   median step, plain     {mp * 1e3:8.2f} ms")
    print(f"   median step, shipped   {ms * 1e3:8.2f} ms")
    print(f"   shipping's extra cost  {(ms - mp) / mp:+7.2%} of the step, {(ms - mp) * 1e3:+.2f} ms (goal <= 1%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--compute", type=int, default=1400, help="matrix size of the simulated step's work")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    events = [step_events(s, args.samples, args.tokens) for s in range(1, args.steps + 1)]
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-ship-"))
    try:
        throughput(root, events)
        lag(root, events, 2)
        loop_cost(root, events, args.compute, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
