"""Does TRL's GRPOTrainer resume bit-identically? Inside the first epoch, and after it.

    python tools/trl_resume_epochs.py --trl-python /path/to/venv/bin/python

The goodput bench's TRL job (tools/bench_goodput.py: the same tiny Llama, reward and settings) on 40 prompts
(10 steps an epoch), 30 steps, save_steps 5, three times: uninterrupted; SIGKILLed after step 8 (epoch 0) and
resumed from checkpoint-5; SIGKILLed after step 27 (epoch 2) and resumed from checkpoint-25. It prints whether
each resumed run ends with the uninterrupted run's weights, bit for bit. The likely cause of a difference,
read in the code (TRL 1.16, transformers 5): TRL's RepeatSampler seeds its generator once and has no
set_epoch, and a resumed Trainer does not replay the epochs before, so a resume after epoch 0 draws epoch 0's
prompt order again. About 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_goodput as bench  # noqa: E402

PROMPTS, STEPS, SAVE_STEPS = 40, 30, 5


def run(py: str, script: Path, model: Path, out: Path, kill_after: int | None) -> None:
    """Train to the end, SIGKILLed once after step `kill_after` and restarted from the newest complete checkpoint."""
    killed = False
    while True:
        p = subprocess.Popen([py, str(script), str(model), str(out), str(STEPS), str(SAVE_STEPS), bench.trl_checkpoint(out), str(bench.LR)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **bench.ENV, bench.COUNT: str(out.parent / f"{out.name}.scored")})
        tail: list[str] = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            if (m := re.match(r"TRL STEP (\d+)", line)) and kill_after and not killed and int(m.group(1)) == kill_after:
                p.send_signal(signal.SIGKILL)
                killed = True
        if p.wait() == 0:
            return
        if p.returncode != -signal.SIGKILL:
            raise SystemExit(f"the TRL script exited {p.returncode}:\n{''.join(tail)}")
        print(f"  {out.name}: killed after step {kill_after}; resuming from {Path(bench.trl_checkpoint(out)).name}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trl-python", default=sys.executable)
    args = ap.parse_args()
    probe = subprocess.run([args.trl_python, "-c", "import trl, verlj.engine; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"TRL (or verlj, for the reward) cannot be imported by {args.trl_python} (pip install trl, or --trl-python)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="verlj-trl-epochs-") as tmp:
        root = Path(tmp)
        model = bench.trl_model_dir(root)
        rows = json.loads((model / "rows.json").read_text())[:PROMPTS]
        (model / "rows.json").write_text(json.dumps(rows))
        script = root / "trl_grpo.py"
        script.write_text(bench.TRL_SCRIPT)
        steps_per_epoch = PROMPTS // bench.PROMPTS
        runs = {"uninterrupted": None, "killed in epoch 0": 8, "killed in epoch 2": 27}
        for name, after in runs.items():
            run(args.trl_python, script, model, root / name.replace(" ", "-"), after)
        ref = root / "uninterrupted" / "final"
        print(f"TRL {probe.stdout.strip()}: {PROMPTS} prompts, {steps_per_epoch} steps an epoch, {STEPS} steps, save_steps {SAVE_STEPS}")
        for name, after in runs.items():
            if after:
                same = bench.trl_weights_equal(ref, root / name.replace(" ", "-") / "final")
                print(f"{name} (after step {after}, resumed from checkpoint-{after // SAVE_STEPS * SAVE_STEPS}): "
                      f"{'bit-identical' if same else 'other weights'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
