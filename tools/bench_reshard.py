"""Resharding benchmark: resuming on another topology against resuming on the same one.

    python tools/bench_reshard.py                 # the built-in model and a ~50M-parameter one
    python tools/bench_reshard.py --sizes tiny

For each model: a 2-rank ZeRO-2 run trains 3 steps (its final snapshot is step 3), then three copies
of it resume for one more step, each timed from launch to exit, side by side:
  - same topology (2 ranks, ZeRO-2): DeepSpeed's own load;
  - 1 rank, ZeRO-2, first time: the snapshot is converted to the universal layout, then loaded;
  - 1 rank, ZeRO-2, again: the converted form is cached.
Prints the conversion time (as the resume reports it), each resume's wall time, and the ratios
against the same-topology resume. Absolute times on a shared 2-core machine mean little; the
ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["data.prompts_per_step=2", "rollout.n=2", "rollout.max_response_length=4", "model.actor.micro_batch_size=4",
          "trainer.save_interval=2", "trainer.save_total_limit=0", "logging.progress=lines", "distributed.zero_stage=2"]
SIZES = {
    "tiny": [],
    "50M": ["model.tiny.hidden_size=512", "model.tiny.num_layers=16", "model.tiny.intermediate_size=1408",
            "model.tiny.num_heads=8"],
}


def verlj(run: Path, over: list[str], ranks: int, resume: bool) -> tuple[float, str]:
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                                                  "--master_port", str(free_port())]
    cmd = [*launch, "-m", "verlj.cli", "train", "--output-dir", str(run), *COMMON, *over, *(["--resume"] if resume else [])]
    print(f"  ... {' '.join(cmd[cmd.index('train') - 2:][:4])} {'--resume' if resume else ''} ({ranks} rank(s))", flush=True)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    dt = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return dt, out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_of(size: str) -> str:
    out = subprocess.run([sys.executable, "-c", (
        "from verlj.engine.config import make_config; from verlj.engine.rl.models import load_causal_lm;"
        f"cfg = make_config(None, {COMMON + SIZES[size]!r});"
        "m = load_causal_lm(cfg.model.actor.model_name_or_path, cfg, 0);"
        "print(sum(p.numel() for p in m.parameters()))")], capture_output=True, text=True, cwd=REPO)
    return f"{int(out.stdout.strip()) / 1e6:.1f}M" if out.returncode == 0 else "?"


def bench(size: str, root: Path) -> None:
    over = SIZES[size]
    src = root / f"{size}-src"
    verlj(src, [*over, "trainer.total_steps=3"], 2, False)
    rows = []
    same = root / f"{size}-same"
    shutil.copytree(src, same, symlinks=True)
    rows.append(("same topology (2 ranks, ZeRO-2)", *verlj(same, [*over, "trainer.total_steps=4"], 2, True)))
    other = root / f"{size}-other"
    shutil.copytree(src, other, symlinks=True)
    rows.append(("1 rank, ZeRO-2, converting", *verlj(other, [*over, "trainer.total_steps=4"], 1, True)))
    again = root / f"{size}-again"
    shutil.copytree(src, again, symlinks=True)
    shutil.copytree(other / "step_00003" / "universal", again / "step_00003" / "universal")
    rows.append(("1 rank, ZeRO-2, converted form cached", *verlj(again, [*over, "trainer.total_steps=4"], 1, True)))
    convert = re.search(r"converted in ([0-9.]+) s", rows[1][2])
    base = rows[0][1]
    print(f"\n{size} model ({params_of(size)} parameters); snapshot conversion {convert.group(1) if convert else '?'} s")
    for name, dt, _ in rows:
        print(f"  {name:42s} resume to the first new step {dt:7.2f} s   {dt / base:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_reshard-"))
    try:
        for size in args.sizes:
            bench(size, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
