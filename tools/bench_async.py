"""Async rollout against sync rollout, side by side in one run on the same work.

    python tools/bench_async.py                      # about 2 minutes on 2 cores
    python tools/bench_async.py --steps 16 --repeats 5 --response-length 128
    python tools/bench_async.py --engine vllm        # the same with vLLM generating (colocated vs in the generator)

Each repeat trains the same GRPO job three times with `verlj train` — rollout.mode=sync, then
rollout.mode=async with max_staleness 1 in step order (step s+1's batch generated while step s
trains), then in completion order (the generator free-running, k rounds ahead) — each
side on one thread (the trainer with trainer.num_threads=1; the generator process takes the
trainer's count). Steps after the first two are kept (the first starts the generator and builds
the first batches). Printed, as medians over the kept steps of all repeats:

  - the step time of each mode (`timing_s/step`: collect, update, waiting for the generator) and
    async over sync (the goal here: <= 0.7), for each order;
  - the bound of that ratio, max(gen, rest) / (gen + rest), from the sync run's generation time and
    the rest of its step: overlap can hide the shorter of the two, nothing more;
  - the journal commit's share of an async step (`timing_s/commit` over step + commit): the cost of
    making every completed batch durable before a step may count on it (the goal: <= 1%).

Absolute times depend on the machine and its neighbours; the ratios are what to compare. The async
win needs a core for each side: another process on the second core takes it away (1.07, 1.26 and
0.83 were measured with another job running). So each ratio is printed with the load average and
the cores the bench had, and with a warning when other processes held a core's worth of CPU
(from /proc/stat, less the bench's own children) on average during its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Load:
    """The CPU that processes other than this bench's runs used while they ran: /proc/stat's busy time
    less the CPU time of this process's children, over the wall time, in cores."""

    def __init__(self):
        self.others = self.wall = 0.0
        self.loadavg: list[float] = []

    @staticmethod
    def _busy() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return float("nan")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def measure(self, fn):
        busy, mine, t = self._busy(), self._children(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t
        self.others += max(0.0, (self._busy() - busy) - (self._children() - mine))
        self.wall += wall
        self.loadavg.append(os.getloadavg()[0])
        return out

    def cores_held(self) -> float:
        return self.others / self.wall if self.wall else float("nan")

    def say(self) -> str:
        return (f"load {min(self.loadavg):.1f}-{max(self.loadavg):.1f}, {CORES} core(s) to the bench, "
                f"others held {self.cores_held():.2f} core(s)")


CORES = len(os.sched_getaffinity(0))


def run(out: Path, mode: str, args) -> list[dict]:
    order = "completion" if mode == "completion" else "step"
    mode = "async" if mode == "completion" else mode
    over = [
        f"trainer.total_steps={args.steps}", "trainer.num_threads=1", "trainer.save_interval=0", "logging.progress=off",
        f"rollout.max_response_length={args.response_length}", "rollout.ignore_eos=true", "data.max_prompt_length=16",
        f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}", "model.actor.use_kl_loss=false", f"rollout.mode={mode}",
        *(["rollout.max_staleness=1", f"rollout.async_order={order}"] if mode == "async" else []), f"rollout.engine={args.engine}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    env.pop("VERLJ_FAILPOINT", None)
    proc = subprocess.run([sys.executable, "-m", "verlj.cli", "train", "--output-dir", str(out), *over], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"verlj train ({mode}) failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[2:]


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--response-length", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="what generates (rollout.engine)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-async-"))
    rows: dict[str, list[dict]] = {"sync": [], "async": [], "completion": []}
    load = {mode: Load() for mode in rows}
    try:
        for r in range(args.repeats):
            for mode in ("sync", "async", "completion"):
                rows[mode] += load[mode].measure(lambda mode=mode: run(root / f"{mode}{r}", mode, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync_step, async_step = med(rows["sync"], "timing_s/step"), med(rows["async"], "timing_s/step")
    gen = med(rows["sync"], "timing_s/gen")
    rest = sync_step - gen
    commit = med(rows["async"], "timing_s/commit")
    free_step, free_commit = med(rows["completion"], "timing_s/step"), med(rows["completion"], "timing_s/commit")
    print(f"GRPO, {args.prompts} prompts x {args.n} samples x {args.response_length} tokens, built-in model, {args.engine}, one thread a side; "
          f"medians of steps 3..{args.steps} over {args.repeats} repeats")
    print(f"  sync step            {sync_step:8.4f} s   (generation {gen:.4f} s, the rest {rest:.4f} s)")
    print(f"  async step (k=1)     {async_step:8.4f} s   (waiting for the generator {med(rows['async'], 'timing_s/gen'):.4f} s)")
    print(f"  completion order     {free_step:8.4f} s   (waiting for the generator {med(rows['completion'], 'timing_s/gen'):.4f} s, "
          f"pushing {med(rows['completion'], 'timing_s/weight_sync'):.4f} s)")
    print(f"  async / sync         {async_step / sync_step:8.2f}    step order (goal <= 0.7); async runs: {load['async'].say()}")
    print(f"  completion / sync    {free_step / sync_step:8.2f}    completion order; its runs: {load['completion'].say()}")
    print(f"                                sync runs: {load['sync'].say()}")
    print(f"  bound                {max(gen, rest) / (gen + rest):8.2f}    max(gen, rest) / (gen + rest)")
    print(f"  journal commit share {commit / (async_step + commit):8.2%}    of an async step, step order (goal <= 1%)")
    print(f"  journal commit share {free_commit / (free_step + free_commit):8.2%}    of an async step, completion order")
    if CORES < 2:
        print(f"WARNING: the bench had {CORES} core: async rollout needs a core for each side, so its ratios say nothing here")
    busy = {mode: round(lo.cores_held(), 2) for mode, lo in load.items() if lo.cores_held() >= 0.5}
    if busy:
        print("WARNING: other processes held half a core or more on average during the runs ("
              + ", ".join(f"{mode} {held} core(s)" for mode, held in busy.items()) + "): the async win needs a core for each side, "
              "so these ratios are not the machine's; measure again on an idle machine")


if __name__ == "__main__":
    main()
