"""Journal append benchmark: the journal against the floor of raw LMDB puts, measured side by side.

    python tools/bench_journal.py                 # full run (~1-2 min, ~1.7 GB scratch disk)
    python tools/bench_journal.py --steps 100 --growth-steps 5000   # quick look

What it prints (all measured in this one run):
  - per-step commit latency (median, p99), records/s and bytes per step for realistic step records
    (64 samples x 256 token ids, their log-probs, rewards, 40 metrics), fsynced commits;
  - the floor: raw LMDB puts of the very same framed bytes with the same sync setting, no encoding or
    hashing, interleaved with the journal's appends so both see the same disk weather;
    the ratio journal/floor (goal <= 1.3);
  - growth: append latency near step 1,000 against near step 100,000 (goal <= 1.2). The journal is
    filled to there with append_steps (1,000 steps per transaction) using medium records, then single
    fsynced appends are timed at both depths.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from verlj.journal import Journal, make_event, packb
from verlj.journal.events import ENVELOPE_VERSION, SUMMARY_TYPES
from verlj.journal.store import frame_plain, frame_step, step_key


def step_events(step: int, rng: np.random.Generator, samples: int, tokens: int) -> list[dict]:
    return [
        make_event("data", epoch=0, cursor=step * 8, indices=np.arange(8, dtype=np.int64) + step * 8),
        make_event("rng", seeds={"data": step, "rollout": step + 1, "train": step + 2}),
        make_event(
            "buffer.add",
            ids=np.arange(samples, dtype=np.int64) + step * samples,
            samples={
                "prompt_ids": rng.integers(0, 32000, (samples, 64), dtype=np.int32),
                "response_ids": rng.integers(0, 32000, (samples, tokens), dtype=np.int32),
                "logprobs": rng.standard_normal((samples, tokens)).astype(np.float32),
                "rewards": rng.standard_normal(samples).astype(np.float32),
            },
        ),
        make_event("buffer.consume", ids=np.arange(samples, dtype=np.int64) + step * samples),
        make_event("metrics", values={f"actor/metric_{i}": float(rng.standard_normal()) for i in range(40)}),
        make_event("state", fingerprint=rng.bytes(32).hex()),
    ]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_vs_floor(root: Path, steps: int, samples: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    records = [step_events(s, rng, samples, tokens) for s in range(1, steps + 1)]
    jpath, fpath = root / "journal", root / "floor"
    journal = Journal.open_writer(jpath)
    floor_env = lmdb.open(str(fpath), map_size=1 << 34, max_dbs=4, subdir=True)  # same flags: sync on
    floor_db = floor_env.open_db(b"steps")
    floor_summary = floor_env.open_db(b"summary")
    j_times, f_times, sizes = [], [], []
    for s, events in enumerate(records, start=1):
        # The floor writes the bytes the journal stores for this step (the record and its summary
        # entry, in their two sub-databases); building them here is not timed.
        raw = frame_step(packb({"v": ENVELOPE_VERSION, "step": s, "time": 0.0, "events": events}), bytes(32))
        summary = frame_plain(packb({"step": s, "time": 0.0, "events": [e for e in events if e["type"] in SUMMARY_TYPES]}))
        sizes.append(len(raw) + len(summary))

        def floor_put():
            t = time.perf_counter()
            with floor_env.begin(write=True) as txn:
                txn.put(step_key(s), raw, db=floor_db, append=True)
                txn.put(step_key(s), summary, db=floor_summary, append=True)
            f_times.append(time.perf_counter() - t)

        def journal_append():
            t = time.perf_counter()
            journal.append_step(s, events)
            j_times.append(time.perf_counter() - t)

        # alternate who goes first so neither always follows the other's fsync
        for fn in (floor_put, journal_append) if s % 2 else (journal_append, floor_put):
            fn()
    journal.close()
    floor_env.close()
    jm, fm = statistics.median(j_times), statistics.median(f_times)
    print(f"records: {steps} steps of {samples} samples x {tokens} tokens, {statistics.mean(sizes) / 1024:.1f} KiB/step stored")
    print(f"journal append: median {jm * 1e3:.2f} ms, p99 {pct(j_times, 0.99) * 1e3:.2f} ms, {steps / sum(j_times):.0f} records/s")
    print(f"raw LMDB floor: median {fm * 1e3:.2f} ms, p99 {pct(f_times, 0.99) * 1e3:.2f} ms, {steps / sum(f_times):.0f} records/s")
    print(f"ratio journal/floor: median {jm / fm:.2f}x, total {sum(j_times) / sum(f_times):.2f}x  (goal <= 1.3)")


def bench_growth(root: Path, far: int, samples: int, tokens: int, probes: int) -> None:
    """Append latency near step 1,000 and near step `far`, for the journal and for raw LMDB puts alike."""
    rng = np.random.default_rng(1)
    template = step_events(1, rng, samples, tokens)
    journal = Journal.open_writer(root / "growth")
    raw_value = summary_value = None
    floor_env = lmdb.open(str(root / "growth-floor"), map_size=1 << 34, max_dbs=4, subdir=True)
    floor_db = floor_env.open_db(b"steps")
    floor_summary = floor_env.open_db(b"summary")

    def journal_put(s: int) -> None:
        journal.append_step(s, template)

    def floor_put(s: int) -> None:
        with floor_env.begin(write=True) as txn:
            txn.put(step_key(s), raw_value, db=floor_db, append=True)
            txn.put(step_key(s), summary_value, db=floor_summary, append=True)

    def journal_fill(a: int, b: int) -> None:
        journal.append_steps([(k, template) for k in range(a, b)])

    def floor_fill(a: int, b: int) -> None:
        with floor_env.begin(write=True) as txn:
            for k in range(a, b):
                txn.put(step_key(k), raw_value, db=floor_db, append=True)
                txn.put(step_key(k), summary_value, db=floor_summary, append=True)

    journal_put(1)
    raw_value = journal.read_raw(1)
    summary_value = frame_plain(packb(journal.read_summary(1)))
    floor_put(1)
    last = {"journal": 1, "floor": 1}

    def fill_to(name, fill, target):
        s = last[name] + 1
        while s <= target:
            n = min(1000, target - s + 1)
            fill(s, s + n)
            s += n
        last[name] = target

    def probe(name, put, at):
        out = []
        for s in range(at, at + probes):
            t0 = time.perf_counter()
            put(s)
            out.append(time.perf_counter() - t0)
        last[name] = at + probes - 1
        return statistics.median(out)

    results = {}
    for at in (1000, far):
        for name, fill, put in (("journal", journal_fill, journal_put), ("floor", floor_fill, floor_put)):
            fill_to(name, fill, at - 1)
            os.sync()  # let the fill's writeback finish so every probe starts from a quiet disk
            time.sleep(1.0)
            results[(name, at)] = probe(name, put, at)
    size = (root / "growth" / "data.mdb").stat().st_size
    journal.close()
    floor_env.close()
    for name in ("journal", "floor"):
        a, b = results[(name, 1000)], results[(name, far)]
        print(f"growth {name:7s}: median append at step 1,000 {a * 1e3:.2f} ms, at step {far:,} {b * 1e3:.2f} ms -> {b / a:.2f}x")
    jg = results[("journal", far)] / results[("journal", 1000)]
    fg = results[("floor", far)] / results[("floor", 1000)]
    print(f"growth ratio: journal {jg:.2f}x (goal <= 1.2), raw LMDB {fg:.2f}x on the same disk; "
          f"journal's own share {jg / fg:.2f}x; journal {size / 2**30:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--growth-steps", type=int, default=100_000)
    ap.add_argument("--growth-samples", type=int, default=8)
    ap.add_argument("--growth-tokens", type=int, default=128)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-", dir=args.dir))
    try:
        bench_vs_floor(root, args.steps, args.samples, args.tokens)
        bench_growth(root, args.growth_steps, args.growth_samples, args.growth_tokens, args.probes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
