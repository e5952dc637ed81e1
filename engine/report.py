"""What a run tells people: log lines, a rich progress bar, metrics.jsonl, TensorBoard, Weights & Biases.

W&B (``logging.wandb``) writes under RUN/wandb; one W&B run per verlj run (its id derives from the
run directory), continued on resume. ``WANDB_MODE=offline`` works without network (``wandb sync``
uploads later).

metrics.jsonl, TensorBoard and W&B are projections of the journal: a killed process leaves them
short of what it committed (W&B's service buffers, TensorBoard flushes every two minutes), so a
resume first asks each sink which step it holds last and re-sends, from the journal's metrics, every
committed step after it, in order (:meth:`Reporter.catch_up`). A step a sink already holds is never
sent to it again, so each step reaches each sink once (after a node loss, the steps run again were
delivered by the lost node already, with the same values). What a sink holds is read from the sink
itself: the last line of metrics.jsonl, TensorBoard's event files, W&B's local run files.

Only rank 0 reports. On a terminal the bar shows step, reward, loss and step time; elsewhere
(CI, a log file) plain lines in the tutorial's style: ``[INFO] Step 50: ...``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .config import LoggingConfig

JSONL_SINK, TENSORBOARD_SINK, WANDB_SINK = "metrics.jsonl", "TensorBoard", "W&B"
SINKS = (JSONL_SINK, TENSORBOARD_SINK, WANDB_SINK)

# the metrics the progress line shows (names in the open-ended metrics map, declared here once)
REWARD_MEAN, PG_LOSS, STEP_TIME = "critic/score/mean", "actor/pg_loss", "timing_s/step"
SKIPPED_UPDATE = "actor/skipped_update"  # rl.update: the step had no sample to train on
JSONL_STEP = "step"  # metrics.jsonl: each line is {JSONL_STEP: step, **the step's metrics}


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


class Reporter:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, enabled: bool, total_steps: int, sinks: bool = True):
        """`enabled`: this rank reports (rank 0); `sinks`: it owns the run's metrics sinks (the writer
        of the run: a replay or verify of it prints lines only and never touches them)."""
        self.cfg = cfg
        self.enabled = enabled
        self.total = total_steps
        self.run_dir = Path(run_dir)
        # each open only while its sink is on (None otherwise): what uses one asks for that sink
        self._jsonl: Any = None
        self._tb: Any = None
        self._wandb: Any = None
        self._bar: Any = None
        self._task: Any = None
        self._held: dict[str, int] = {}  # sink -> the last step it held when this process started (catch_up)
        self.mode = "off"
        if not enabled:
            return
        mode = cfg.progress
        self.mode = ("bar" if sys.stderr.isatty() else "lines") if mode == "auto" else mode
        if not sinks:
            return
        if cfg.jsonl:
            path = self.run_dir / "metrics.jsonl"
            self._held[JSONL_SINK] = _jsonl_last_step(path)  # and a line torn by a kill is cut off
            self._jsonl = open(path, "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._held[TENSORBOARD_SINK] = _tensorboard_last_step(self.run_dir / "tensorboard")
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if cfg.wandb:
            self._held[WANDB_SINK] = wandb_last_step(self.run_dir)
            self._wandb = _start_wandb(cfg, self.run_dir)

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

    def catch_up(self, committed: Callable[[int], Iterable[tuple[int, dict[str, float]]]], last: int) -> None:
        """On resume: send each sink the committed steps after the last one it holds, in order.
        `committed(first)`: an iterator of (step, journaled metrics) from step `first` on; `last`:
        the last committed step."""
        behind = {sink: held for sink, held in self._held.items() if held < last}
        if not behind:
            return
        for step, metrics in committed(min(behind.values()) + 1):
            self._send(step, metrics, [sink for sink, held in behind.items() if step > held])
        spans: dict[str, list[str]] = {}
        for sink in sorted(behind, key=SINKS.index):
            first = behind[sink] + 1
            spans.setdefault(f"step {first}" if first == last else f"steps {first}–{last}", []).append(sink)
        self.info("Re-sent from the journal what the interrupted run had committed but not delivered: "
                  + "; ".join(f"{span} to {' and '.join(sinks)}" for span, sinks in spans.items()))

    def _send(self, step: int, metrics: dict[str, float], sinks: Iterable[str]) -> None:
        for sink in sinks:
            if sink == JSONL_SINK:
                self._jsonl.write(json.dumps({JSONL_STEP: step, **metrics}, allow_nan=True) + "\n")
            elif sink == TENSORBOARD_SINK:
                for k, v in metrics.items():
                    self._tb.add_scalar(k, v, step)
            else:
                self._wandb.log(metrics, step=step)

    def step(self, step: int, metrics: dict[str, float], note: str = "") -> None:
        """Send a committed step's metrics to the sinks, and its line to the console; `note`: what the line
        adds (the step's faults: rl.faults.note; the held-out eval's, with the first one's reason)."""
        if not self.enabled:
            return
        # a step a sink held before this process started came from a process that ran it already
        # (a node lost with its unshipped steps): its values were the same, it is not sent again
        self._send(step, metrics, [sink for sink, held in self._held.items() if step > held])
        if metrics.get(SKIPPED_UPDATE):  # no sample to train on (every group dropped or faulted): no reward, no loss
            summary = f"no update (no sample to train on) time={metrics.get(STEP_TIME, float('nan')):.2f}s"
        else:
            summary = (
                f"reward={_fmt(metrics.get(REWARD_MEAN, float('nan')))} "
                f"loss={_fmt(metrics.get(PG_LOSS, float('nan')))} "
                f"time={metrics.get(STEP_TIME, float('nan')):.2f}s"
            )
        summary += f" {note}" if note else ""
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


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of a verlj run: its directory's name and a digest of its path."""
    run_dir = Path(run_dir)
    return f"{run_dir.name[:40]}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


def _start_wandb(cfg: LoggingConfig, run_dir: Path):
    import wandb

    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.wandb_project or "verlj", name=run_dir.name, id=wandb_run_id(run_dir), resume="allow",
                      dir=str(run_dir), settings=wandb.Settings(silent=True, console="off"))


# ----------------------------------------------------------------------------- what each sink holds


def _jsonl_last_step(path: Path) -> int:
    """The step of metrics.jsonl's last line (0: none). A last line without its newline (a kill
    mid-write) is cut off first. Reads the file's tail only."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    with open(path, "rb+") as f:
        tail_at = max(0, size - (1 << 16))
        f.seek(tail_at)
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            keep = tail.rfind(b"\n") + 1
            f.truncate(tail_at + keep)
            tail = tail[:keep]
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)[JSONL_STEP])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _tensorboard_last_step(log_dir: Path) -> int:
    """The highest step of any scalar in the event files under log_dir (a torn tail is ignored). Each
    process writes its own file and sends only steps after those its predecessors hold, so the newest
    file holding any scalar holds the highest step: older files are not read."""
    if not log_dir.is_dir():
        return 0
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for path in sorted(log_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime, reverse=True):
        steps = [int(e.step) for e in EventFileLoader(str(path)).Load() if e.HasField("summary") and e.summary.value]
        if steps:
            return max(steps)
    return 0


def wandb_last_step(run_dir: Path) -> int:
    """The highest step W&B's local run files under RUN/wandb record for this run (0: none)."""
    steps = wandb_steps(run_dir)
    return max(steps) if steps else 0


def wandb_steps(run_dir: Path) -> list[int]:
    """Every step of every history record in this run's W&B transaction logs (RUN/wandb/*-ID/run-ID.wandb,
    one per process that logged: online or offline), in the order they were written."""
    from wandb.proto import wandb_internal_pb2

    run_id = wandb_run_id(run_dir)
    steps: list[int] = []
    root = Path(run_dir) / "wandb"
    if not root.is_dir():
        return steps
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.endswith(f"-{run_id}")):
        log = d / f"run-{run_id}.wandb"
        if not log.is_file():
            continue
        for data in _leveldb_records(log.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            if record.history.HasField("step"):  # wandb.log(..., step=N) as the client sends it
                steps.append(int(record.history.step.num))
            else:  # as the service stores a row it numbered itself
                steps += [int(json.loads(i.value_json)) for i in record.history.item if i.key == "_step"]
    return steps


_BLOCK = 32768  # W&B's transaction log is LevelDB's log format: 32 KiB blocks of checksummed records
_RECORD = struct.Struct("<IHB")  # crc32 of type and data, data length, type (1 full, 2 first, 3 middle, 4 last)


def _leveldb_records(raw: bytes) -> Iterable[bytes]:
    """The records of a W&B transaction log, after its 7-byte header (':W&B', magic, version); stops at
    the first torn or damaged record (a kill mid-write). W&B's Python package no longer reads these."""
    pos, pending = 7, None
    while pos + _RECORD.size <= len(raw):
        if _BLOCK - pos % _BLOCK < _RECORD.size:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = _RECORD.unpack_from(raw, pos)
        data = raw[pos + _RECORD.size : pos + _RECORD.size + length]
        if kind == 0 and length == 0:  # zero padding
            pos += _BLOCK - pos % _BLOCK
            continue
        if len(data) < length or zlib.crc32(bytes([kind]) + data) & 0xFFFFFFFF != crc:
            return
        pos += _RECORD.size + length
        if kind == 1:
            yield data
        elif kind == 2:
            pending = data
        elif kind == 3 and pending is not None:
            pending += data
        elif kind == 4 and pending is not None:
            yield pending + data
            pending = None
