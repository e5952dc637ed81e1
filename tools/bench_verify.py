"""`verlj verify` throughput against `sha256sum` over the same snapshot files, in one run.

    python tools/bench_verify.py                # builds a run with ~0.5 GiB of snapshots, ~1-2 min

verify hashes every file with BLAKE3 in 4 MiB chunks (flat memory) and also opens the DeepSpeed
files weights-only; sha256sum only hashes. Both read the files from the page cache after a
warm-up read, so the comparison is CPU against CPU.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from verlj.engine.loop.run import train
    from verlj.engine.post_mortem.verify import verify_run

    root = Path(tempfile.mkdtemp(prefix="verlj-bench-verify-"))
    try:
        run = root / "run"
        train(run, None, ["trainer.total_steps=2", "trainer.save_interval=1", "trainer.save_total_limit=0",
                          f"model.tiny.hidden_size={args.hidden}", f"model.tiny.num_layers={args.layers}",
                          f"model.tiny.intermediate_size={args.hidden * 2}", "data.prompts_per_step=2", "rollout.n=2",
                          "logging.progress=off"])
        files = sorted(str(p) for p in run.rglob("step_*/**/*") if p.is_file())
        total = sum(Path(f).stat().st_size for f in files)
        for f in files:  # warm the page cache for both
            Path(f).read_bytes()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        v, s = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            report = verify_run(run)
            v.append(time.perf_counter() - t)
            assert report.ok
            t = time.perf_counter()
            subprocess.run(["sha256sum", *files], check=True, capture_output=True)
            s.append(time.perf_counter() - t)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        mb = total / 2**20
        vt, st = statistics.median(v), statistics.median(s)
        print(f"{len(files)} snapshot files, {mb:.0f} MiB")
        print(f"verlj verify (journal + manifests + weights-only parse): {mb / vt:.0f} MiB/s ({vt:.2f} s)")
        print(f"sha256sum of the same files:                            {mb / st:.0f} MiB/s ({st:.2f} s)")
        print(f"verify / sha256sum speed: {st / vt:.2f}x; peak RSS grew {max(0, rss1 - rss0) / 1024:.0f} MiB while verifying "
              f"{mb:.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
