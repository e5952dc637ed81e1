"""Recovery benchmark, one run, everything measured side by side in this process.

    python tools/bench_recovery.py              # ~2-3 min on 2 cores
    python tools/bench_recovery.py --k 5

Prints:
  - replay time per step over live time per step (goal <= 0.3: replay skips generation and reward);
  - crash recovery k steps after a snapshot (load + replay k journaled steps) against re-running
    those k steps live from the snapshot, which is what checkpoint-only tools do;
  - the time the loop is blocked by an async snapshot over a synchronous snapshot's (goal <= 0.1);
  - a synchronous snapshot's time over a plain write + fsync of the same bytes.
Responses are 64 tokens (rollout.ignore_eos) on a 4-layer, 256-wide Llama.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

MODEL = ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.intermediate_size=512",
         "rollout.max_response_length=64", "rollout.ignore_eos=true", "data.max_prompt_length=16",
         "data.prompts_per_step=8", "rollout.n=8", "logging.progress=off"]


class Silent:
    def info(self, msg):
        pass

    def warn(self, msg):
        pass

    def step(self, *a):
        pass


def plain_write(src: Path, dst: Path) -> float:
    """Write the same files (same sizes, same bytes) with open/write/fsync, then fsync the dirs."""
    blobs = [(p.relative_to(src), p.read_bytes()) for p in sorted(src.rglob("*")) if p.is_file()]
    t = time.perf_counter()
    for rel, data in blobs:
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    for d in {(dst / rel).parent for rel, _ in blobs} | {dst}:
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=10, help="steps between the snapshot and the crash")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    k = args.k

    from verlj.engine.config import config_from_dict
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.loop.checkpointer import make_run
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.loop.recovery import replay, restore
    from verlj.engine.loop.run import train
    from verlj.engine.rl.trainer import Trainer
    from verlj.journal import Journal

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-recovery-"))
    try:
        run = root / "run"
        total = 2 * k
        train(run, None, [f"trainer.total_steps={total}", f"trainer.save_interval={k}", "trainer.save_total_limit=0", *MODEL])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        live = [r["timing_s/step"] + r["timing_s/commit"] for r in rows if r["step"] > k]
        live_step = statistics.median(live)

        journal = Ledger.open_reader(run)
        history = journal.history()
        cfg = config_from_dict(journal.identity.first_config())
        rt = setup(cfg)
        configure_determinism(cfg)

        def fresh():
            return make_run(run, rt, Trainer(cfg, rt), Silent(), journal)

        recov, replay_per_step, rerun = [], [], []
        for _ in range(args.repeats):
            r = fresh()
            t0 = time.perf_counter()
            restored = restore(r, k)
            t1 = time.perf_counter()
            replay(r, history, restored, total)
            t2 = time.perf_counter()
            recov.append(t2 - t0)
            replay_per_step.append((t2 - t1) / k)
            r.trainer.close()

            r = fresh()
            t0 = time.perf_counter()
            restore(r, k)
            for step in range(k + 1, total + 1):  # what a checkpoint-only tool redoes
                inputs = r.source.collect(step)
                r.trainer.apply(step, inputs, r.trainer.take(step, inputs))
                r.source.weights_changed()
            rerun.append(time.perf_counter() - t0)
            r.source.close()
            r.trainer.close()

        r_step = statistics.median(replay_per_step)
        print(f"live step (median, steps {k + 1}-{total}): {live_step * 1e3:.1f} ms; replayed step: {r_step * 1e3:.1f} ms "
              f"-> replay/live {r_step / live_step:.2f} (goal <= 0.3)")
        print(f"crash {k} steps after a snapshot: recover (load + replay) {statistics.median(recov):.2f} s vs "
              f"re-run live from the snapshot {statistics.median(rerun):.2f} s -> {statistics.median(recov) / statistics.median(rerun):.2f}x")

        # snapshots: sync, async (blocked part), plain write of the same bytes
        trainer = fresh().trainer
        scratch = root / "snaps"
        scratch.mkdir()
        sj = Ledger(Journal.open_writer(scratch / "journal"))
        sync_t, blocked_t, plain_t, snap_t = [], [], [], []
        for i in range(args.repeats):
            for async_save in (False, True):
                c = copy.deepcopy(cfg)
                c.trainer.async_save = async_save
                c.trainer.save_total_limit = 0
                trainer.set_config(c)  # the checkpointer reads the trainer's config
                sm = make_run(scratch, rt, trainer, Silent(), sj).ckpt
                step = 100 + 2 * i + int(async_save)
                t = time.perf_counter()
                sm.save(step, "bench")
                elapsed = time.perf_counter() - t
                sm.wait()
                if async_save:
                    blocked_t.append(sm.blocked_s)
                else:
                    sync_t.append(elapsed)
                    snap_dir = scratch / f"step_{step:05d}"
                    plain_t.append(plain_write(snap_dir, root / f"plain{i}"))
                    snap_t.append(elapsed)
        size = sum(p.stat().st_size for p in (scratch / "step_00100").rglob("*") if p.is_file())
        s, b, p = statistics.median(sync_t), statistics.median(blocked_t), statistics.median(plain_t)
        print(f"snapshot of {size / 2**20:.1f} MiB: sync {s:.3f} s, async blocks the loop {b:.3f} s -> async/sync {b / s:.3f} (goal <= 0.1)")
        print(f"sync snapshot {s:.3f} s vs plain write+fsync of the same bytes {p:.3f} s -> {s / p:.2f}x")
        sj.close()
        journal.close()
        trainer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
