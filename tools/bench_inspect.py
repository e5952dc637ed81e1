"""Single-step questions on a 100,000-step journal: how long they take (goal: well under a second).

    python tools/bench_inspect.py                       # builds a synthetic 100k-step journal (~1-2 min)
    python tools/bench_inspect.py --steps 20000

The journal is written with append_steps (1,000 steps per transaction) from realistic records
(16 samples x 32 tokens, 40 metrics); then, in this process after a warm-up, it times:
inspect --step N, a metrics window of 10 steps, verify of one record range, find over all steps,
and the run summary; and the CLI's wall time for `verlj inspect RUN --step N` (process start included).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def events(step: int, rng) -> list:
    from verlj.engine.schema.sample import Sample, pack
    from verlj.journal import make_event

    samples = [Sample(
        id=step * 16 + i, index=i, group=step * 16 + i - i % 4, score=float(rng.random()), rule_reward=0.0,
        rm_score=0.0, policy_version=step - 1, prompt_ids=rng.integers(4, 19, 6), response_ids=rng.integers(4, 19, 32),
        gen_logprobs=rng.standard_normal(32).astype(np.float32),
        ref_logprobs=rng.standard_normal(32).astype(np.float32)) for i in range(16)]
    cols = pack(samples)
    metrics = {f"actor/m{i}": float(rng.standard_normal()) for i in range(38)}
    metrics["critic/score/mean"] = float(rng.random())
    metrics["actor/grad_norm"] = float("nan") if step == 77_777 else float(rng.random())
    return [
        make_event("data", epoch=0, cursor=step * 4, indices=np.arange(4, dtype=np.int64), rounds=1),
        make_event("rng", seeds={"rollout": step, "train": step}, digests={}),
        make_event("buffer.add", ids=cols["id"], samples=cols),
        make_event("buffer.drop", ids=np.zeros(0, dtype=np.int64), reason="zero_variance"),
        make_event("buffer.consume", ids=cols["id"]),
        make_event("metrics", values=metrics),
        make_event("state", fingerprint=f"{step:064x}", parts={}),
    ]


def timed(fn, repeats=5):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    args = ap.parse_args()

    from verlj.engine.config import Config
    from verlj.engine.post_mortem import inspection, metrics
    from verlj.journal import Journal

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-inspect-"))
    try:
        run = root / "run"
        rng = np.random.default_rng(0)
        template = [events(s, rng) for s in range(1, 101)]
        t = time.perf_counter()
        with Journal.open_writer(run / "journal") as j:
            j.meta.set("config", Config().to_dict())
            j.meta.set("world_size", 1)
            for a in range(1, args.steps + 1, 1000):
                j.writer.append_steps([(s, events(s, rng) if s == 77_777 else template[s % 100]) for s in range(a, min(args.steps, a + 999) + 1)])
        size = sum(p.stat().st_size for p in (run / "journal").glob("*.mdb"))
        print(f"built a {args.steps:,}-step journal ({size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
        mid = args.steps // 2
        print(f"inspect --step {mid:,}:             {timed(lambda: inspection.step_detail(run, mid)) * 1e3:8.1f} ms")
        print(f"metrics --steps {mid}:{mid + 9}:       {timed(lambda: metrics.metric_rows(run, None, f'{mid}:{mid + 9}')) * 1e3:8.1f} ms")
        print(f"run summary (inspect RUN):          {timed(lambda: inspection.run_summary(run)) * 1e3:8.1f} ms")
        print(f"find --where 'actor/grad_norm is nan' over all steps: {timed(lambda: metrics.find_steps(run, 'actor/grad_norm is nan'), 1):8.2f} s")
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "verlj.cli", "inspect", str(run), "--step", str(mid)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        print(f"`verlj inspect RUN --step {mid}` wall time, process start included: {time.perf_counter() - t:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
