"""Snapshots: the whole resumable state of a run at a step, written and read in one place.

    RUN/step_00050/
      actor/  critic/          DeepSpeed save_checkpoint(tag=name): weights, optimizer, LR scheduler
                               (ZeRO / TP shards, one file per rank as DeepSpeed lays them out)
      dataflow_anchor.msgpack  every rank-agnostic Stateful part: {name: part.state_dict()}
                               (sampler, rollout buffer, train state, checkpoint schedule)
      rng_rank00000.msgpack    the global generators of each rank (seeding.RNGState)
      meta.json                step, fingerprint, config hash, topology
      manifest.json            every file above: size and BLAKE3 digest (state.manifest)

The parts come from one registry (:meth:`Checkpointer.parts`), as torchtitan's checkpoint manager
gathers its Stateful objects: the sharded ones (the DeepSpeed engines of the actor and critic)
through DeepSpeed's own save/load, the others through state_dict / load_state_dict, encoded as
msgpack. Loading never unpickles anything but tensors (state.safe_load).

:class:`Checkpointer` decides (loop.policy), writes (sync, or async), hands the directory to the
store to publish and rotate (loop.snapshot_store), and loads.

An async snapshot copies nothing on the loop's thread: DeepSpeed hands its state dicts to
safe_load's wrapper, which holds the live tensors, and a background thread writes them (making
views and device tensors host copies of their own as it goes) while the loop collects the next
step. The loop changes no trained state before the next update: it calls :meth:`Checkpointer.settle`
before each apply, which waits until the held tensors are written (fsync and publish go on in
the background). What the loop waited for, in save() and there, is ``blocked_s``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import platform
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verlj.journal import JournalError, packb, unpackb
from verlj.journal.durable import write_synced
from verlj.journal.failpoints import failpoint
from verlj.journal.space import files_under, write_failure_cause

from ..errors import RunError, SnapshotError
from ..state import reshard
from ..state.manifest import ANCHOR, META, SnapshotMeta, fsync_tree, snapshot_name
from ..state.safe_load import install_safe_checkpointing, save_portable, saveable
from ..state.seeding import RNGState
from ..state.stateful import Stateful
from ..state.topology import Topology, refusal
from . import pruning
from .context import Run
from .mirror import Mirror, mirror_root
from .policy import CheckpointSchedule
from .records import Resharded
from .snapshot_store import SnapshotStore

if TYPE_CHECKING:
    from ..dist import Runtime
    from ..report import Reporter
    from ..rl.buffer import RolloutBuffer
    from ..rl.data import Sampler
    from ..rl.trainer import Trainer, TrainState
    from .ledger import Ledger

    def _stateful(sampler: Sampler, buffer: RolloutBuffer, train_state: TrainState, schedule: CheckpointSchedule,
                  rng: RNGState) -> list[Stateful]:
        """Every part a snapshot keeps by state_dict is a Stateful: mypy fails here when one stops being one."""
        return [sampler, buffer, train_state, schedule, rng]


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.msgpack"


ANCHOR_PART, RANK_PART, ENGINE_PART = "anchor", "rank", "engine"


@dataclass
class Part:
    """One resumable part of the run and where a snapshot keeps it (its `kind`):

    anchor  a Stateful that is the same on every rank: rank 0 writes its state_dict into
            dataflow_anchor.msgpack (sampler, rollout buffer, train state, checkpoint schedule)
    rank    a Stateful of each rank's own: rng_rankNNNNN.msgpack (the global generators)
    engine  a DeepSpeed engine: DeepSpeed writes and reads its sharded files under <name>/ (weights,
            optimizer, LR scheduler); another topology's are read through their universal form
    """

    name: str
    kind: str
    obj: Any  # a Stateful (anchor, rank) or a DeepSpeed engine (engine)
    optional: bool = False  # snapshots written before the part existed lack it: it keeps its initial state


def make_run(run_dir: Path, rt: Runtime, trainer: Trainer, reporter: Reporter, ledger: Ledger | None = None) -> Run:
    """The run being driven (loop.context.Run), made whole at once: its checkpointer first, from the
    parts it serves; the topology and the snapshot schedule from the config the trainer is under (the
    run's); its rollout source and player, over the run's durable log. The one way a Run is made. `ledger`: rank 0's (None on the other ranks, and for a run
    without a journal)."""
    from ..rl.sources import make_source
    from .durable_log import DurableLog

    topology = Topology.of_runtime(rt, trainer.cfg)
    ckpt = Checkpointer(run_dir, rt, trainer, reporter, ledger, topology)
    source = make_source(trainer.rollout_parts(DurableLog(rt, ledger)))  # the rollout, assembled once for the run's config
    return Run(run_dir, rt, trainer, reporter, ledger, topology, ckpt, source)


class Checkpointer:
    """Snapshots of a live run (or a materialized state): schedule, write, publish, load. What it reads
    of the config it reads from the trainer's (the state's), but for the topology it loads into (this
    process's) and the schedule's policy, both fixed when the run is made."""

    def __init__(self, run_dir: Path, rt: Runtime, trainer: Trainer, reporter: Reporter, ledger: Ledger | None, topology: Topology):
        self.run_dir, self.rt, self.trainer, self.reporter, self.ledger = run_dir, rt, trainer, reporter, ledger
        self.topology = topology
        self.store = SnapshotStore(run_dir, ledger)
        self.schedule = CheckpointSchedule(trainer.cfg.trainer)
        self.rng = RNGState()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._error_cause: str | None = None
        self.tried: list[int] = []  # the steps a snapshot was written at, this process
        self.failed: dict[int, str] = {}  # step -> why its snapshot failed (the run goes on: the journal holds every step)
        self.last_saved: int | None = None
        self.blocked_s = 0.0  # how long the last snapshot blocked the loop (save, and settle for an async one)
        self.write_s = 0.0  # the last snapshot's write, from save() to published (async: in the background)
        self._held = threading.Event()  # clear while an async snapshot holds live tensors it has not written
        self._held.set()
        self.mirror = self._mirror()  # the memory mirror (loop.mirror), None when trainer.mirror_interval is 0
        self.mirror_blocked_s = 0.0  # how long the last mirror blocked the loop (its save, and the next settle)
        self._mirror_error: str | None = None  # why this rank's last mirror failed (the next one stops mirroring)
        self._holding_mirror = False
        self._mirror_said = False
        for engine in trainer.engines().values():
            install_safe_checkpointing(engine)

    def _mirror(self) -> Mirror | None:
        tc = self.trainer.cfg.trainer
        if tc.mirror_interval <= 0:
            return None
        if len(set(self.rt.all_gather_obj(socket.gethostname()))) > 1:  # (collective: every rank makes its checkpointer)
            self.reporter.warn(f"trainer.mirror_interval={tc.mirror_interval}: the ranks are on several machines, and a "
                               "mirror serves a restart on one; training without it")
            return None
        return Mirror(mirror_root(self.run_dir, tc.mirror_dir), tc.mirror_interval)

    def parts(self) -> list[Part]:
        """The registry of everything a snapshot holds: the one list save and load walk."""
        trainer = self.trainer
        out = [Part(tag, ENGINE_PART, engine) for tag, engine in trainer.engines().items()]
        anchored: dict[str, Stateful] = {**trainer.state_parts(), "checkpoint_schedule": self.schedule}
        out += [Part(name, ANCHOR_PART, part, optional=name in ("train_state", "checkpoint_schedule")) for name, part in anchored.items()]
        out.append(Part("rng", RANK_PART, self.rng))
        return out

    # ------------------------------------------------------------------ deciding

    def due(self, step: int, metrics: dict) -> bool:
        """Whether the schedule wants a snapshot after this live step. Asked before the step is
        committed, so a policy that fails costs the step it failed on, never a committed one."""
        return self.rt.all_true(self.schedule.observe(step, metrics, self.trainer.train_state.trainer_state()))

    def after_step(self, step: int, fingerprint: str, due: bool) -> None:
        """A live step is committed: snapshot it if it is due."""
        if due and self.last_saved != step:
            self.try_save(step, fingerprint)
        elif self.mirror is not None and self.mirror.due(step):
            self.try_mirror(step, fingerprint)

    def replayed(self, step: int, metrics: dict) -> None:
        """A replayed step: the schedule sees its journaled metrics as the live run's did."""
        self.schedule.observe(step, metrics, self.trainer.train_state.trainer_state())

    # ------------------------------------------------------------------ writing

    def try_save(self, step: int, fp: str) -> bool:
        """A snapshot that fails (disk full, I/O error) costs only that snapshot: the journal still
        holds every step, so training goes on and recovery replays from an older one."""
        error = ""
        self.tried.append(step)
        try:
            self.save(step, fp)
        except SnapshotError as e:  # the previous (background) snapshot's failure: already said why
            error = str(e)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError ('unexpected pos ...')
            tmp = self.store.tmp_dir(step)
            error = write_failure_cause(e, tmp, files_under(tmp)) or (str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        if not self.rt.all_true(not error):
            self.failed[step] = error or "on another rank"
            self.reporter.warn(f"Snapshot at step {step} failed: {error or 'on another rank'}; training continues, "
                               "the journal still holds every step")
            if self.rt.is_main:
                shutil.rmtree(self.store.tmp_dir(step), ignore_errors=True)
            return False
        return True

    def try_mirror(self, step: int, fp: str) -> None:
        """Mirror the state after `step` into memory (loop.mirror), written in the background as an async snapshot is.
        Collective. A mirror that does not fit, or whose write failed, stops the mirroring in one line: the run goes
        on, and a restart loads a snapshot from disk as it would without one."""
        mirror = self.mirror
        assert mirror is not None  # after_step asks only with one
        t = time.perf_counter()
        self._join()  # one snapshot or mirror in flight at a time: waiting for the one before counts in this one's hold
        why = self._mirror_error or self._mirror_room(mirror)
        if not self.rt.all_true(why is None):
            self.reporter.warn(f"trainer.mirror_interval: not mirroring the state after step {step} or later: "
                               f"{why or 'on another rank'}; a restart loads the newest snapshot from disk")
            self.mirror = None
            if self.rt.is_main:
                mirror.clear()
            return
        if mirror.last_bytes is not None and not self._mirror_said:  # rank 0's first mirror, published: what mirrors hold
            self._mirror_said = True
            self.reporter.info(f"Step {step}: mirroring the state after every {mirror.interval} step(s) into {mirror.root} "
                               f"({_mib(mirror.last_bytes)} a mirror, two held in memory)")
        self._write(step, fp, mirror.tmp_dir(step), publish=False, mirror=True)
        self.mirror_blocked_s = time.perf_counter() - t

    def mirror_timing(self) -> dict[str, float]:
        """The step being committed's timing_s/mirror: how long the last mirror held the loop (its save, after the step
        before, and this step's wait for its write before the update); none while not mirroring."""
        if self.mirror is None:
            return {}
        blocked, self.mirror_blocked_s = self.mirror_blocked_s, 0.0
        return {"timing_s/mirror": blocked}

    def _mirror_room(self, mirror: Mirror) -> str | None:
        """Why the next mirror cannot be written (None: it can): the room it needs where mirrors go (the last one's
        bytes, or 16 bytes a parameter before the first: weights, fp32 masters and Adam's two moments)."""
        need = mirror.last_bytes
        if need is None:
            need = 16 * sum(getattr(p, "ds_numel", p.numel()) for e in self.trainer.engines().values() for p in e.module.parameters())
        try:
            if self.rt.is_main:
                mirror.root.mkdir(parents=True, exist_ok=True)
            fits, free = mirror.room(need)
        except OSError as e:
            return f"{mirror.root}: {e.strerror or e}"
        if not fits:
            return (f"it needs about {_mib(need)} and {mirror.root.parent} has {_mib(free)} free "
                    "(trainer.mirror_dir names another place)")
        return None

    def failures(self) -> str | None:
        """One line for the end of a run whose snapshots failed (None when none did): how many, which,
        and why, so that the exit code and the summary tell a scheduler."""
        if not self.failed:
            return None
        steps = sorted(self.failed)
        whys = list(dict.fromkeys(self.failed[s] for s in steps))
        return (f"{len(steps)} of {len(set(self.tried))} (step{'' if len(steps) == 1 else 's'} "
                f"{', '.join(map(str, steps))}): {whys[0]}" + (f" (and {len(whys) - 1} other reason(s))" if len(whys) > 1 else "")
                + "; every step is in the journal, and a resume replays from the newest snapshot that was written")

    def save(self, step: int, fp: str) -> None:
        """Snapshot the state after `step` into the run: published, indexed, rotated."""
        self.wait()  # one snapshot in flight at a time
        self._write(step, fp, self.store.tmp_dir(step), publish=True)

    def write_standalone(self, step: int, fp: str, out_dir: Path) -> None:
        """Snapshot the current state into out_dir (manifest included; no journal, no rotation)."""
        self.wait()
        tmp = out_dir.parent / f".tmp-{out_dir.name}"
        self._write(step, fp, tmp, publish=False)
        if self.rt.is_main:
            SnapshotStore.publish_standalone(tmp, out_dir)
        self.rt.barrier()

    def _write(self, step: int, fp: str, tmp: Path, publish: bool, mirror: bool = False) -> None:
        rt = self.rt
        if rt.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        rt.barrier()
        t0 = time.perf_counter()
        async_save = (self.trainer.cfg.trainer.async_save and publish) or mirror  # a mirror is always written in the background
        deferred: list[tuple[str, object]] = []  # async: DeepSpeed's state dicts, holding the live tensors, written in the background
        small: dict[str, bytes] = {}
        anchor: dict[str, dict] = {}
        for part in self.parts():
            if part.kind == ENGINE_PART:
                ce = install_safe_checkpointing(part.obj)
                saving: contextlib.AbstractContextManager[list[tuple[str, object]]] = ce.deferring() if async_save else contextlib.nullcontext([])
                with saving as held:
                    part.obj.save_checkpoint(str(tmp), tag=part.name, client_state={}, save_latest=False,
                                             exclude_frozen_parameters=_has_frozen(part.obj))
                deferred += held
            elif part.kind == RANK_PART:
                small[rng_file(rt.rank)] = packb(part.obj.state_dict())
            else:
                anchor[part.name] = part.obj.state_dict()
        engines = [p.name for p in self.parts() if p.kind == ENGINE_PART]
        if rt.is_main:
            small[ANCHOR] = packb(anchor)
            small[META] = json.dumps(SnapshotMeta(
                step=step,
                fingerprint=fp,
                config_hash=self.trainer.cfg.hash(),
                engines=engines,
                world_size=rt.world_size,
                tensor_parallel_size=rt.tp_size,
                zero_stage=self.topology.zero_stage,
                time=time.time(),
                python=platform.python_version(),  # the pickled form of an enum depends on it (state.safe_load)
            ).to_dict(), indent=2).encode()
        if mirror:
            self._holding_mirror = True
        else:
            self.blocked_s = time.perf_counter() - t0
            self.last_saved = step
        if async_save:
            self._held.clear()
            self._thread = threading.Thread(target=self._finish_async, args=(step, fp, tmp, deferred, small, t0, mirror), daemon=True)
            self._thread.start()
            if not mirror:
                self.reporter.info(f"Step {step}: Saving checkpoint to {self.run_dir / snapshot_name(step)} in the background...")
            return
        _write_small(tmp, small)
        failpoint("snapshot.mid_write")
        fsync_tree(tmp)
        rt.barrier()  # every rank's files are durable
        if publish:
            if rt.is_main:
                self._publish(step, fp, tmp)
            rt.barrier()
            self.reporter.info(f"Step {step}: Saving checkpoint to {self.run_dir / snapshot_name(step)}...")
            if rt.is_main:
                self._retain()
        self.write_s = time.perf_counter() - t0

    def _finish_async(self, step, fp, tmp: Path, deferred, small, t0: float, mirror: bool = False) -> None:
        """Background: write the held state (then the loop may change it: settle), mark this rank done;
        rank 0 waits for all, then publishes (a mirror: into the mirror's place, loop.mirror; not fsynced).
        A rank whose write fails marks that instead, and rank 0 stops waiting: it fails too (and alone removes
        a mirror's files)."""
        try:
            try:
                failpoint("mirror.held" if mirror else "snapshot.held")  # the live tensors held, none written yet
                for path, state in deferred:
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    save_portable(saveable(state), path)
            finally:
                deferred.clear()
                self._held.set()
            _write_small(tmp, small)
            if failpoint("mirror.mid_write" if mirror else "snapshot.mid_write") == f"fail-rank{self.rt.rank}":
                raise OSError(errno.EIO, f"rank {self.rt.rank}'s write failed (failpoint)")
            if not mirror:
                fsync_tree(tmp)
            write_synced(tmp / f".done-rank{self.rt.rank:05d}", b"")
            if self.rt.is_main:
                self._await_ranks(tmp)
                if mirror:
                    assert self.mirror is not None  # set while mirroring
                    self.mirror.publish(step, tmp)
                else:
                    self._publish(step, fp, tmp)
                    self._retain()
            if not mirror:
                self.write_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() (a mirror's: by the next try_mirror)
            with contextlib.suppress(OSError):  # rank 0 is waiting for this rank: it must not wait forever
                write_synced(tmp / f".failed-rank{self.rt.rank:05d}", b"")
            cause = write_failure_cause(e, tmp, files_under(tmp))
            if mirror:
                self._mirror_error = cause or str(e).splitlines()[0][:300] or type(e).__name__
                if self.rt.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                return
            self._error, self._error_step = e, step
            self._error_cause = cause

    def _await_ranks(self, tmp: Path) -> None:
        """Rank 0, in the background: until every rank has marked its files written; an error when one marked a failure."""
        markers = [tmp / f".done-rank{r:05d}" for r in range(self.rt.world_size)]
        while not all(m.exists() for m in markers):
            failed = sorted(tmp.glob(".failed-rank*"))
            if failed:
                raise RuntimeError(f"rank {int(failed[0].name.removeprefix('.failed-rank'))} could not write its part")
            time.sleep(0.01)
        for m in markers:
            m.unlink()

    def _publish(self, step: int, fp: str, tmp: Path) -> None:
        self.store.publish(step, fp, tmp)
        self.write_metadata(step, saved=True)
        self.store.rotate(self.trainer.cfg.trainer.save_total_limit)

    def _retain(self) -> None:
        """Rank 0, after a snapshot is published and rotation is done: prune what no kept snapshot needs."""
        try:
            pruning.apply(self.run_dir, self.trainer.cfg, self.ledger, self.reporter)
        except (RunError, JournalError, OSError) as e:  # the samples stay; the next snapshot tries again
            self.reporter.warn(f"journal retention did not run: {e}")

    def settle(self) -> None:
        """Block until an in-flight async snapshot has written the live tensors it holds, so that the
        trained state may change (the loop calls it before each update); the wait counts in blocked_s."""
        if not self._held.is_set():
            t = time.perf_counter()
            self._held.wait()
            if self._holding_mirror:
                self.mirror_blocked_s += time.perf_counter() - t
            else:
                self.blocked_s += time.perf_counter() - t
        self._holding_mirror = False

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Block until an in-flight async snapshot (or mirror) is published (or raise a snapshot's error)."""
        self._join()
        if self._error is not None:
            err, self._error = self._error, None
            assert self._error_step is not None  # set with _error
            why = self._error_cause or (str(err).splitlines()[0][:300] if str(err) else type(err).__name__)
            self.failed[self._error_step] = why
            raise SnapshotError(f"background snapshot of step {self._error_step} failed: {why}")

    def finish(self, finished: bool = False) -> None:
        """The loop ends: the snapshot in flight published. `finished`: the run reached trainer.total_steps, and its
        memory mirrors are removed (no restart needs them; a stop keeps them for the next one)."""
        try:
            self.wait()
        except SnapshotError as e:
            self.reporter.warn(f"{e}; the journal still holds every step")
        if finished and self.mirror is not None and self.rt.is_main:
            self.mirror.clear()
        self.rt.barrier()

    def write_metadata(self, step: int, resume_from: str | None = None, saved: bool = False) -> None:
        sampler, state = self.trainer.sampler, self.trainer.train_state
        assert self.ledger is not None  # rank 0's
        self.ledger.write_train_metadata(self.run_dir, step=step, epoch=sampler.epoch, samples_seen=state.samples_seen,
                                         config_hash=self.trainer.cfg.hash(), resume_from=resume_from, saved=saved)

    # ------------------------------------------------------------------ loading

    def load(self, path: Path) -> tuple[SnapshotMeta, Resharded | None]:
        """Load a verified snapshot into every part of the registry, in one loop (collective).
        Returns its meta, and how it was resharded (None: it was written under this topology)."""
        self.settle()  # an async snapshot still writing the state this load replaces
        meta = SnapshotMeta.read(path)
        engines = [p.name for p in self.parts() if p.kind == ENGINE_PART]
        if sorted(meta.engines) != sorted(engines):
            raise SnapshotError(f"{path} holds engines {meta.engines}, this run has {engines}")
        src, dst = meta.topology, self.topology
        resharded = universal = None
        if src != dst:  # another topology's files: through their universal form, converted once
            universal, resharded = self._converted(path, meta, src, dst)
        anchor = unpackb((path / ANCHOR).read_bytes())
        own = path / rng_file(self.rt.rank)  # a rank the snapshot's topology did not have takes rank 0's
        for part in self.parts():
            if part.kind == ENGINE_PART:
                self._load_engine(part, path, universal)
            elif part.kind == RANK_PART:
                part.obj.load_state_dict(unpackb((own if own.is_file() else path / rng_file(0)).read_bytes()))
            elif part.name in anchor:
                part.obj.load_state_dict(anchor[part.name])
            elif not part.optional:
                raise SnapshotError(f"{path / ANCHOR} has no {part.name!r} state")
        return meta, resharded  # no rollout engine holds older weights: a run's source makes its engine at its first live step, after this

    def _load_engine(self, part: Part, path: Path, universal: Path | None) -> None:
        engine, tag = part.obj, part.name
        if universal is not None:
            reshard.load(engine, tag, universal, self.rt)
            reshard.check_loaded(engine, tag, universal, self.rt, self.trainer.param_layout()[tag])
            return
        install_safe_checkpointing(engine)
        load_path, _ = engine.load_checkpoint(  # a frozen base (LoRA) is not in the snapshot: it stays as loaded
            str(path), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=not _has_frozen(engine)
        )
        if load_path is None:
            raise SnapshotError(f"DeepSpeed found no checkpoint for {tag!r} in {path}")

    def _converted(self, path: Path, meta: SnapshotMeta, src, dst) -> tuple[Path, Resharded]:
        """The universal form of a snapshot written under another topology (state.reshard), converted by
        rank 0 unless a valid converted form is cached. Collective. Returns (its root, what was done)."""
        why = refusal(src, dst, self.trainer.cfg.algorithm.loss_normalization)
        if why:
            raise SnapshotError(f"{path} was saved on {src}; this run is on {dst}: {why}")
        layout = self.trainer.param_layout()

        def convert() -> list:
            try:
                root, seconds = reshard.ensure_converted(path, meta, layout)
            except (OSError, RuntimeError) as e:  # DeepSpeed's converter fails in many words: its first line
                raise SnapshotError(str(e).splitlines()[0][:300] if str(e) else type(e).__name__) from None
            return [str(root), seconds]

        root, seconds = self.rt.from_rank0(convert, f"converting {path.name} to the universal layout")
        return Path(root), Resharded(src, dst, seconds, seconds == 0.0)


def _has_frozen(engine) -> bool:
    """The engine trains part of its module (LoRA adapters on a frozen base): a snapshot holds the trained part only."""
    return any(not p.requires_grad for p in engine.module.parameters())


def _write_small(tmp: Path, small: dict[str, bytes]) -> None:
    for fname, data in small.items():
        write_synced(tmp / fname, data)


def _mib(n: int) -> str:
    """Bytes in MiB as a line says them: one decimal under 10 MiB (a small model's mirror is not "0 MiB")."""
    return f"{n / 2**20:.1f} MiB" if n < 10 * 2**20 else f"{n / 2**20:,.0f} MiB"
