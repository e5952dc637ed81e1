"""What a run tells people: log lines, a rich progress bar, metrics.jsonl, TensorBoard, Weights & Biases.

W&B (``logging.wandb``) writes under RUN/wandb; one W&B run per verlj run (its id derives from the
run directory), continued on resume. ``WANDB_MODE=offline`` works without network (``wandb sync``
uploads later).

Only rank 0 reports. On a terminal the bar shows step, reward, loss and step time; elsewhere
(CI, a log file) plain lines in the tutorial's style: ``[INFO] Step 50: ...``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .config import LoggingConfig


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


class Reporter:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, enabled: bool, total_steps: int):
        self.cfg = cfg
        self.enabled = enabled
        self.total = total_steps
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        self._task = None
        if not enabled:
            return
        if cfg.jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if cfg.wandb:
            self._wandb = _start_wandb(cfg, Path(run_dir))
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(f"[INFO] {msg}", markup=False, highlight=False)
        else:
            print(f"[INFO] {msg}", flush=True)

    def warn(self, msg: str) -> None:
        if not self.enabled:
            return
        print(f"[WARNING] {msg}", file=sys.stderr, flush=True)

    def start(self, first_step: int) -> None:
        if not self.enabled or self.mode != "bar":
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("train", total=self.total, completed=first_step - 1, stats="")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        summary = (
            f"reward={_fmt(metrics.get('critic/score/mean', float('nan')))} "
            f"loss={_fmt(metrics.get('actor/pg_loss', float('nan')))} "
            f"time={metrics.get('timing_s/step', float('nan')):.2f}s"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=summary)
        elif self.mode == "lines" and step % self.cfg.log_interval == 0:
            print(f"[INFO] Step {step}: {summary}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(cfg: LoggingConfig, run_dir: Path):
    import hashlib

    import wandb

    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"{run_dir.name[:40]}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
    return wandb.init(project=cfg.wandb_project or "verlj", name=run_dir.name, id=run_id, resume="allow",
                      dir=str(run_dir), settings=wandb.Settings(silent=True, console="off"))
