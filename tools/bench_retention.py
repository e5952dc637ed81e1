"""Does the journal stay bounded? data.mdb at step N against step N/2, with and without retention.

    python tools/bench_retention.py                      # journal only, realistic records (~1 min)
    python tools/bench_retention.py --train              # a real `verlj train` run (slow: ~10-20 min)
    python tools/bench_retention.py --shipped --steps 20000   # journal.local_dir: the run directory's segments

Journal mode appends step records shaped like the engine's (bench_journal.samples_columns: 64
samples x 128 tokens by default) to two journals side by side in one process, snapshotting every
--save-interval steps with save_total_limit=2: one prunes through the oldest kept snapshot after
each snapshot (journal.retain_samples=since_oldest_snapshot, via the same retention.prune_bound the
trainer uses), the other keeps everything. Train mode runs the built-in model with those settings
to step N/2, then resumes it to step N (`--resume`, as a long job would be), and does the same with
retain_samples=all. Both print the used size of data.mdb (the pages LMDB has handed out: the file
never shrinks, freed pages are reused) at N/2 and N, the ratio (goal <= 1.1 with retention), and
what every step keeps after pruning (its record without samples).

Shipped mode writes the same records through journal.local_dir's shipper (ship_max_lag_steps=2,
retention on, the default segment_fanout): the run directory's segments, bytes and file count at N/2
and N, then rebuilds a local journal from the segments alone (what a resume on a new node does) and
times it against a plain copy of the same files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_journal import step_events  # noqa: E402

from verlj.engine.loop.pruning import prune_bound  # noqa: E402
from verlj.journal import Journal, open_journal_reader, segments  # noqa: E402
from verlj.journal.frames import StepFrame  # noqa: E402


def used_bytes(j: Journal) -> int:
    info, stat = j.store.env().info(), j.store.env().stat()
    return (info["last_pgno"] + 1) * stat["psize"]


def kept_per_step(j: Journal, step: int) -> int:
    return len(StepFrame.parse(j.read_raw(step)).without_payload())  # the core is also the step's summary


def journal_mode(root: Path, steps: int, interval: int, samples: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    templates = [step_events(s, rng, samples, tokens) for s in range(1, 9)]  # reused: building records is not the point
    journals = {"retention": Journal.open_writer(root / "retention"), "all": Journal.open_writer(root / "all")}
    snaps: list[int] = []
    sizes: dict = {}
    prune_time = append_time = 0.0
    for s in range(1, steps + 1):
        events = templates[s % len(templates)]
        for name, j in journals.items():
            t = time.perf_counter()
            j.writer.append_step(s, events)
            if name == "retention":
                append_time += time.perf_counter() - t
        if s % interval == 0:
            snaps = [*snaps, s][-2:]  # save_total_limit=2
            bound = prune_bound("since_oldest_snapshot", snaps, s)
            t = time.perf_counter()
            if bound > journals["retention"].retention.pruned_through():
                journals["retention"].retention.prune(bound)
            prune_time += time.perf_counter() - t
        if s in (steps // 2, steps):
            sizes[s] = {name: used_bytes(j) for name, j in journals.items()}
    kept = kept_per_step(journals["retention"], journals["retention"].retention.pruned_through())
    full = len(journals["all"].read_raw(steps))
    for j in journals.values():
        j.close()
    report(sizes, steps, kept, full, f"journal only: {steps} steps of {samples} samples x {tokens} tokens, snapshot every {interval}")
    print(f"  pruning took {prune_time / append_time * 100:.2f}% of the time spent appending")


def shipped_mode(root: Path, steps: int, interval: int, samples: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    templates = [step_events(s, rng, samples, tokens) for s in range(1, 9)]
    shipped = root / "run" / "journal"
    j, _notes = segments.open_writer(root / "local", shipped, 2, retention=True)
    snaps: list[int] = []
    seen: dict = {}
    most = 0

    def files() -> list[Path]:
        return sorted(segments.segment_dir(shipped).glob("*.seg"))

    with j:
        for s in range(1, steps + 1):
            j.writer.append_step(s, templates[s % len(templates)])
            if s % interval == 0:
                j.meta.add_snapshot(s, {"path": f"step_{s:06d}"})
                snaps = [*snaps, s]
                if len(snaps) > 2:  # save_total_limit=2
                    j.meta.remove_snapshot(snaps.pop(0))
                bound = prune_bound("since_oldest_snapshot", snaps, s)
                if bound > j.retention.pruned_through():
                    j.shipping.make_durable()
                    j.retention.prune(bound)
            if s % 100 == 0:
                most = max(most, len(files()))
            if s in (steps // 2, steps):
                j.shipping.make_durable()
                while j.shipping.shipper.compact_once():  # what the rule leaves once compaction has caught up
                    pass
                seen[s] = (sum(p.stat().st_size for p in files()), len(files()), j.shipping.shipper.compactions)
        problem = j.shipping.shipper.compaction_problem
    half = steps // 2
    print(f"shipped journal (journal.local_dir, retention since_oldest_snapshot, snapshot every {interval}, 2 kept): "
          f"{steps} steps of {samples} samples x {tokens} tokens")
    for s in (half, steps):
        size, n, done = seen[s]
        print(f"  step {s:6d}: segments {size / 2**20:7.1f} MiB in {n} files once compaction caught up ({done} compactions so far)")
    print(f"  segments at step {steps} over step {half}: {seen[steps][0] / seen[half][0]:.2f}x  (goal <= 1.05); "
          f"most files at once: {most}" + (f"; compaction stopped: {problem}" if problem else ""))
    copy_times, rebuild_times = [], []
    for rep in range(5):
        t = time.perf_counter()
        dest = root / f"copy{rep}"
        dest.mkdir()
        for p in files():
            shutil.copyfile(p, dest / p.name)
            with open(dest / p.name, "rb+") as f:
                os.fsync(f.fileno())
        copy_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        segments.rebuild(shipped, root / f"rebuilt{rep}")
        rebuild_times.append(time.perf_counter() - t)
    c, r = min(copy_times), min(rebuild_times)
    print(f"  a new node's rebuild from the segments alone: {r:.2f} s against {c:.2f} s for a plain copy (+ fsync) "
          f"of the same files: {r / c:.2f}x (best of 5 each)")


def train_mode(root: Path, steps: int, interval: int) -> None:
    base = [sys.executable, "-m", "verlj.cli", "train", "trainer.save_total_limit=2", f"trainer.save_interval={interval}",
            "data.prompts_per_step=8", "rollout.n=8", "rollout.max_response_length=64", "rollout.ignore_eos=true",
            "logging.progress=off", "logging.jsonl=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sizes: dict = {}
    for name, policy in (("retention", "since_oldest_snapshot"), ("all", "all")):
        run = root / name
        for i, upto in enumerate((steps // 2, steps)):
            cmd = [*base, "--output-dir", str(run), f"trainer.total_steps={upto}", f"journal.retain_samples={policy}"]
            subprocess.run([*cmd, "--resume"] if i else cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            with open_journal_reader(run / "journal") as j:
                sizes.setdefault(upto, {})[name] = used_bytes(j)
                if name == "retention" and i:
                    kept, full = kept_per_step(j, j.retention.pruned_through()), len(j.read_raw(steps))
    report(sizes, steps, kept, full, f"verlj train (built-in model, 64 samples x 64 tokens a step): {steps} steps, snapshot every {interval}")


def report(sizes: dict, steps: int, kept: int, full: int, title: str) -> None:
    half = steps // 2
    print(title)
    for name in ("retention", "all"):
        a, b = sizes[half][name], sizes[steps][name]
        goal = "  (goal <= 1.05)" if name == "retention" else ""
        print(f"  {name:9s}: data.mdb used {a / 2**20:7.1f} MiB at step {half}, {b / 2**20:7.1f} MiB at step {steps} -> {b / a:.2f}x{goal}")
    print(f"  a pruned step keeps {kept} bytes (its frame without samples: 103 bytes of header and hashes, then its core, "
          f"which is also its summary); an unpruned one stores {full} bytes")
    grown = sizes[steps]["retention"] - sizes[half]["retention"]
    print(f"  with retention the file grew {grown / (steps - half):.0f} bytes a step from step {half} to {steps} (the kept records and their B-tree pages)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-interval", type=int, default=None, help="default: 200 (journal mode), 250 (train mode: the retained window, two intervals, fills by step 3 x 250)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--train", action="store_true", help="run the real trainer instead of appending records")
    ap.add_argument("--shipped", action="store_true", help="append through journal.local_dir's shipper: the run directory's segments")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="verlj-retention-", dir=args.dir))
    try:
        if args.train:
            train_mode(root, args.steps, args.save_interval or 250)
        elif args.shipped:
            shipped_mode(root, args.steps, args.save_interval or 200, args.samples, args.tokens)
        else:
            journal_mode(root, args.steps, args.save_interval or 200, args.samples, args.tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
