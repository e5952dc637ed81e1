"""Snapshots: DeepSpeed checkpoints plus the dataflow anchor, checksummed and published atomically.

    RUN/step_00050/
      actor/  critic/        engine.save_checkpoint(..., tag=name): weights, optimizer, LR scheduler
                             (ZeRO / TP shards, one file per rank as DeepSpeed lays them out)
      dataflow_anchor.msgpack  sampler epoch + cursor, the rollout buffer's pending samples
      rng_rank00000.msgpack  torch / numpy / python (/ cuda) RNG states, one file per rank
      meta.json              step, fingerprint, config hash, topology
      manifest.json          every file above: size and BLAKE3 digest

Written under ``RUN/.tmp-step_00050``, fsynced, renamed into place, the run directory fsynced;
only then entered in the journal's snapshot index. Rotation (``save_total_limit``) deletes the
oldest only after the newest is published. With ``trainer.async_save`` the loop is blocked only
while DeepSpeed's state dicts are copied to host memory; a background thread writes them.

Loading never unpickles anything but tensors and a short allowlist of DeepSpeed's plain records
(``torch.load(weights_only=True)``), and refuses a snapshot whose manifest does not check out.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

import blake3
import numpy as np
import torch

from verlj.journal import Journal, packb, unpackb
from verlj.journal.failpoints import failpoint

from .config import Config
from .errors import SnapshotError
from .manifest import (
    ANCHOR,
    MANIFEST,
    META,
    SNAPSHOT_VERSION,
    build_manifest,
    fsync_dir,
    fsync_tree,
    snapshot_name,
    write_bytes_durable,
)

# DeepSpeed's checkpoints hold a few plain records besides tensors; these alone may be rebuilt.
_SAFE_GLOBAL_NAMES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _safe_globals() -> list:
    out = []
    for dotted in _SAFE_GLOBAL_NAMES:
        mod, _, name = dotted.rpartition(".")
        out.append(getattr(importlib.import_module(mod), name))
    return out


def _copy_state(obj):
    """A host-memory copy of a state dict that later training cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _copy_state(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _copy_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_state(v) for v in obj)
    return copy.deepcopy(obj)


class SafeCheckpointEngine:
    """Wraps DeepSpeed's checkpoint engine: loads with weights_only=True; can defer saves to memory."""

    def __init__(self, base):
        self._base = base
        self.deferred: list[tuple[str, object]] | None = None

    def __getattr__(self, name):
        return getattr(self._base, name)

    def save(self, state_dict, path: str):
        if self.deferred is not None:
            self.deferred.append((path, _copy_state(state_dict)))
            return None
        return self._base.save(state_dict, path)

    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged or foreign file
            raise SnapshotError(f"cannot load {path}: {str(e).splitlines()[0][:200]}") from None


def install_safe_checkpointing(engine) -> SafeCheckpointEngine:
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state().numpy(),
        "numpy": list(np.random.get_state()),
        "python": _py_rng_to_plain(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy() for s in torch.cuda.get_rng_state_all()]
    return state


def _py_rng_to_plain(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.asarray(s, dtype=np.uint8)) for s in state["cuda"]])


# ----------------------------------------------------------------------------- policy


class CheckpointPolicy:
    """Decides when to snapshot besides `trainer.save_interval`. Subclass and name it in
    `trainer.checkpoint_policy` (a dotted path, e.g. ``mypkg.policies.SaveOnRewardDrop``)."""

    def should_save(self, trainer_state: dict, metrics_history: list[dict]) -> bool:
        raise NotImplementedError


class SaveOnRewardDrop(CheckpointPolicy):
    """Save when the mean reward falls by more than 5% from one step to the next."""

    def __init__(self, drop: float = 0.05):
        self.drop = drop

    def should_save(self, trainer_state, metrics_history):
        r = [m["critic/score/mean"] for m in metrics_history[-2:] if "critic/score/mean" in m]
        return len(r) == 2 and r[1] < r[0] * (1 - self.drop)


def load_policy(dotted: str) -> CheckpointPolicy:
    mod, _, name = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError):
        raise SnapshotError(f"trainer.checkpoint_policy: cannot import {dotted!r}") from None
    policy = cls()
    if not callable(getattr(policy, "should_save", None)):
        raise SnapshotError(f"trainer.checkpoint_policy: {dotted!r} has no should_save(trainer_state, metrics_history)")
    return policy


# ----------------------------------------------------------------------------- manager


class SnapshotManager:
    """Takes, publishes, indexes and rotates snapshots for a live run; loads them on resume."""

    def __init__(self, run_dir: Path, cfg: Config, rt, trainer, journal: Journal | None, reporter):
        self.run_dir, self.cfg, self.rt, self.trainer = Path(run_dir), cfg, rt, trainer
        self.journal, self.reporter = journal, reporter
        self.policy = load_policy(cfg.trainer.checkpoint_policy) if cfg.trainer.checkpoint_policy else None
        self.history: list[dict] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: int | None = None
        self.blocked_s = 0.0  # how long the last snapshot blocked the loop
        for e in trainer.engines().values():
            install_safe_checkpointing(e)

    # ------------------------------------------------------------------ saving

    def after_step(self, step: int, outcome, force: bool = False) -> None:
        self.history.append(outcome.metrics)
        del self.history[:-100]
        interval = self.cfg.trainer.save_interval
        due = force or (interval > 0 and step % interval == 0)
        if not due and self.policy is not None:
            state = {"global_step": step, "epoch": self.trainer.sampler.epoch, "samples_seen": self.trainer.sampler.cursor}
            due = self.rt.all_true(bool(self.policy.should_save(state, self.history)))
        if due and self.last_saved != step:
            self.try_save(step, outcome.fingerprint)

    def try_save(self, step: int, fp: str) -> bool:
        """A snapshot that fails (disk full, I/O error) costs only that snapshot: the journal still
        holds every step, so training goes on and recovery replays from an older one."""
        error = ""
        try:
            self.save(step, fp)
        except (OSError, RuntimeError, SnapshotError) as e:  # torch.save reports a full disk as RuntimeError
            error = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if not self.rt.all_true(not error):
            self.reporter.warn(f"Snapshot at step {step} failed ({error or 'on another rank'}); training continues, "
                               "the journal still holds every step")
            if self.rt.is_main:
                shutil.rmtree(self.run_dir / f".tmp-{snapshot_name(step)}", ignore_errors=True)
            return False
        return True

    def save(self, step: int, fp: str) -> None:
        """Snapshot the state after `step` into the run: published, indexed, rotated."""
        self.wait()  # one snapshot in flight at a time
        tmp = self.run_dir / f".tmp-{snapshot_name(step)}"
        self._capture(step, fp, tmp, publish=True)

    def write_standalone(self, step: int, fp: str, out_dir: Path) -> None:
        """Snapshot the current state into out_dir (manifest included; no journal, no rotation)."""
        self.wait()
        tmp = out_dir.parent / f".tmp-{out_dir.name}"
        self._capture(step, fp, tmp, publish=False)
        if self.rt.is_main:
            write_bytes_durable(tmp / MANIFEST, json.dumps(build_manifest(tmp), indent=1).encode())
            os.replace(tmp, out_dir)
            fsync_dir(out_dir.parent)
        self.rt.barrier()

    def _capture(self, step: int, fp: str, tmp: Path, publish: bool) -> None:
        rt = self.rt
        name = snapshot_name(step)
        if rt.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        rt.barrier()
        t0 = time.perf_counter()
        engines = self.trainer.engines()
        async_save = self.cfg.trainer.async_save and publish
        deferred: list[tuple[str, object]] = []
        for tag, engine in engines.items():
            ce = install_safe_checkpointing(engine)
            ce.deferred = [] if async_save else None
            try:
                engine.save_checkpoint(str(tmp), tag=tag, client_state={}, save_latest=False)
            finally:
                if ce.deferred is not None:
                    deferred += ce.deferred
                ce.deferred = None
        small = {f"rng_rank{rt.rank:05d}.msgpack": packb(rng_state())}
        if rt.is_main:
            small[ANCHOR] = packb(self.trainer.dataflow_state())
            small[META] = json.dumps(
                {
                    "version": SNAPSHOT_VERSION,
                    "step": step,
                    "fingerprint": fp,
                    "config_hash": self.trainer.cfg.hash(),
                    "engines": list(engines),
                    "world_size": rt.world_size,
                    "tensor_parallel_size": rt.tp_size,
                    "zero_stage": self.cfg.distributed.zero_stage,
                    "time": time.time(),
                },
                indent=2,
            ).encode()
        self.blocked_s = time.perf_counter() - t0
        self.last_saved = step
        if async_save:
            self._thread = threading.Thread(target=self._finish_async, args=(step, fp, tmp, deferred, small), daemon=True)
            self._thread.start()
            self.reporter.info(f"Step {step}: Saving checkpoint to {self.run_dir / name} in the background...")
            return
        self._write_small(tmp, small)
        failpoint("snapshot.mid_write")
        fsync_tree(tmp)
        rt.barrier()  # every rank's files are durable
        if publish:
            if rt.is_main:
                self._publish(step, fp, tmp)
            rt.barrier()
            self.reporter.info(f"Step {step}: Saving checkpoint to {self.run_dir / name}...")

    def _write_small(self, tmp: Path, small: dict[str, bytes]) -> None:
        for fname, data in small.items():
            write_bytes_durable(tmp / fname, data)

    def _finish_async(self, step, fp, tmp: Path, deferred, small) -> None:
        """Background: write the copied state, mark this rank done; rank 0 waits for all, then publishes."""
        try:
            for path, state in deferred:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, path)
            self._write_small(tmp, small)
            failpoint("snapshot.mid_write")
            fsync_tree(tmp)
            marker = tmp / f".done-rank{self.rt.rank:05d}"
            write_bytes_durable(marker, b"")
            if self.rt.is_main:
                markers = [tmp / f".done-rank{r:05d}" for r in range(self.rt.world_size)]
                while not all(m.exists() for m in markers):
                    time.sleep(0.01)
                for m in markers:
                    m.unlink()
                self._publish(step, fp, tmp)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e

    def wait(self) -> None:
        """Block until an in-flight async snapshot is published (or raise its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise SnapshotError(f"background snapshot failed: {err}")

    def finish(self) -> None:
        try:
            self.wait()
        except SnapshotError as e:
            self.reporter.warn(f"{e}; the journal still holds every step")
        self.rt.barrier()

    def _publish(self, step: int, fp: str, tmp: Path) -> None:
        """Rank 0: manifest, rename into place, fsync, index in the journal, `latest`, rotate."""
        manifest = build_manifest(tmp)
        manifest_bytes = json.dumps(manifest, indent=1).encode()
        write_bytes_durable(tmp / MANIFEST, manifest_bytes)
        fsync_dir(tmp)
        final = self.run_dir / snapshot_name(step)
        if final.exists():  # a leftover of an earlier attempt at this step: replace it
            trash = self.run_dir / f".trash-{final.name}-{os.getpid()}"
            os.replace(final, trash)
            shutil.rmtree(trash)
        failpoint("snapshot.before_rename")
        os.replace(tmp, final)
        fsync_dir(self.run_dir)
        failpoint("snapshot.before_index")
        self.journal.add_snapshot(
            step,
            {"path": final.name, "fingerprint": fp, "manifest": blake3.blake3(manifest_bytes).hexdigest(), "time": time.time()},
        )
        link_tmp = self.run_dir / ".latest.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(final.name, link_tmp)
        os.replace(link_tmp, self.run_dir / "latest")
        self.write_metadata(step, resume_from=None, last_save=step)
        self._rotate()

    def _rotate(self) -> None:
        limit = self.cfg.trainer.save_total_limit
        if limit <= 0:
            return
        index = self.journal.snapshots()
        for step in sorted(index)[:-limit]:
            self.journal.remove_snapshot(step)  # unindex first: a half-deleted snapshot is never offered
            failpoint("snapshot.rotate")
            path = self.run_dir / index[step]["path"]
            if path.exists():
                trash = self.run_dir / f".trash-{path.name}-{os.getpid()}"
                os.replace(path, trash)
                shutil.rmtree(trash)

    def write_metadata(self, step: int, resume_from: str | None, last_save: int | None = None) -> None:
        from .rundir import git_commit, now_iso, write_json_atomic

        path = self.run_dir / "train_metadata.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        index = self.journal.snapshots()
        newest = max(index) if index else None
        data = {
            "global_step": step,
            "epoch": self.trainer.sampler.epoch,
            "samples_seen": int(self.trainer.sampler.epoch * self.trainer.sampler.size + self.trainer.sampler.cursor)
            * self.cfg.rollout.n,
            "last_save_time": now_iso() if last_save is not None else old.get("last_save_time"),
            "last_snapshot": index[newest]["path"] if newest is not None else None,
            "git_commit": git_commit(),
            "config_hash": self.cfg.hash(),
            "resume_from": resume_from if resume_from is not None else old.get("resume_from"),
        }
        write_json_atomic(path, data)

    # ------------------------------------------------------------------ loading

    def load(self, path: Path) -> dict:
        """Load a verified snapshot into the trainer (collective). Returns its meta."""
        meta = json.loads((path / META).read_text())
        engines = self.trainer.engines()
        if sorted(meta["engines"]) != sorted(engines):
            raise SnapshotError(f"{path} holds engines {meta['engines']}, this run has {list(engines)}")
        if meta["world_size"] != self.rt.world_size or meta["tensor_parallel_size"] != self.rt.tp_size:
            raise SnapshotError(
                f"{path} was saved with {meta['world_size']} ranks (TP {meta['tensor_parallel_size']}); "
                f"this run has {self.rt.world_size} (TP {self.rt.tp_size}); resume with the same topology"
            )
        for tag, engine in engines.items():
            install_safe_checkpointing(engine)
            load_path, _ = engine.load_checkpoint(
                str(path), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=True
            )
            if load_path is None:
                raise SnapshotError(f"DeepSpeed found no checkpoint for {tag!r} in {path}")
        self.trainer.load_dataflow_state(unpackb((path / ANCHOR).read_bytes()))
        rng_file = path / f"rng_rank{self.rt.rank:05d}.msgpack"
        set_rng_state(unpackb(rng_file.read_bytes()))
        return meta
