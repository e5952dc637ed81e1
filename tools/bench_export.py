"""`verlj export --sft` and `verlj verify --against` on a long journal: their time and their memory, which must not
grow with the run's steps.

    python tools/bench_export.py                        # 100,000 steps of 4 samples (12 prompt, 16 response tokens)
    python tools/bench_export.py --steps 10000 --samples 16

Writes a run directory whose journal holds STEPS steps (a ledger's identity, the default config, each step one
group of SAMPLES samples added, as the trainer journals them), then exports it (--sft --tokens, Parquet) and
verifies the export against it, each in a process of its own, and prints for each its wall time and its peak
anonymous memory (RssAnon, sampled every 50 ms: the journal's pages, mapped from its file, are not counted; they
are the page cache's). Compare two lengths to see the memory stay flat.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def make_run(run: Path, steps: int, samples: int, prompt: int, response: int) -> None:
    import numpy as np

    from verlj.engine.config import make_config
    from verlj.engine.loop.ledger import Ledger
    from verlj.engine.schema.events import Added, Metrics
    from verlj.engine.schema.sample import Sample, pack
    from verlj.journal import Journal

    cfg = make_config(None, [f"rollout.n={samples}"])
    rng = np.random.default_rng(0)
    with Journal.open_writer(run / "journal") as j:
        Ledger(j).start({"config": cfg.to_stored(), "config_hash": cfg.hash(), "created": "2026-01-01T00:00:00Z", "world_size": 1})
        batch = []
        for step in range(1, steps + 1):
            g = (step - 1) * samples
            group = [Sample(index=step % 1000, prompt_ids=rng.integers(4, 19, prompt), response_ids=rng.integers(4, 19, response),
                            gen_logprobs=rng.standard_normal(response).astype(np.float32), id=g + k, group=g, score=float(rng.random()),
                            policy_version=step - 1) for k in range(samples)]
            batch.append((step, [Added(np.arange(g, g + samples), pack(group)).to_event(), Metrics({"critic/score/mean": 0.0}).to_event()]))
            if len(batch) == 1000:
                j.writer.append_steps(batch)
                batch = []
        if batch:
            j.writer.append_steps(batch)


def phase(name: str, run: Path, out: Path) -> None:
    """Run one phase here, printing {seconds, peak RssAnon MiB, ...} as JSON."""
    peak = [0]

    def sample() -> None:
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    if name == "export":
        from verlj.engine.post_mortem.distill_files import export_dataset

        said = {"rows": export_dataset(run, out, "sft", "parquet", None, tokens=True).rows}
    else:
        from verlj.engine.post_mortem.distill_verify import verify_export

        rep = verify_export(out, run)
        said = {"rows": rep.rows, "ok": rep.ok}
    time.sleep(0.1)
    print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "peak_anon_mib": round(peak[0] / 1024), **said}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--phase", choices=["export", "verify"], help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        return phase(args.phase, args.run, args.out)
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-export-"))
    try:
        run, out = root / "run", root / "sft"
        t = time.perf_counter()
        make_run(run, args.steps, args.samples, args.prompt, args.response)
        size = sum(p.stat().st_size for p in (run / "journal").iterdir())
        print(f"journal: {args.steps} steps of {args.samples} samples ({args.prompt} + {args.response} tokens), "
              f"{size / 2**20:.0f} MiB, written in {time.perf_counter() - t:.0f} s")
        for name in ("export", "verify"):
            said = subprocess.run([sys.executable, __file__, "--phase", name, "--run", str(run), "--out", str(out)], capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1]
            print(f"{name}: {said}")
        print(f"written: {sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / 2**20:.0f} MiB in {out.name}/")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
