"""Process group, device and the few collectives the trainer needs.

Works the same under ``torchrun --nproc_per_node N`` and as a plain single process (a one-rank
group on a free local port). Objects cross ranks msgpack-encoded as uint8 tensors (the journal's
codec): nothing is pickled, on disk or on the wire.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

from verlj.journal import packb, unpackb

from .config import Config, ConfigError
from .errors import RunError

T = TypeVar("T")


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    # ------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _bytes_tensor(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data else torch.zeros(0, dtype=torch.uint8, device=self.device)

    def all_gather_obj(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        data = packb(obj)
        size = torch.tensor([len(data)], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8, device=self.device)
        buf[: len(data)] = self._bytes_tensor(data)
        bufs = [torch.zeros_like(buf) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf)
        return [unpackb(b[: int(s.item())].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def broadcast_obj(self, obj, src: int = 0):
        """src's obj on every rank."""
        if self.world_size == 1:
            return obj
        data = packb(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.long, device=self.device)
        dist.broadcast(size, src)
        buf = self._bytes_tensor(data) if self.rank == src else torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src)
        return obj if self.rank == src else unpackb(buf.cpu().numpy().tobytes())

    @overload
    def from_rank0(self, fn: Callable[[], T], what: str = "", share: Literal[True] = True) -> T: ...

    @overload
    def from_rank0(self, fn: Callable[[], T], what: str = "", *, share: Literal[False]) -> T | None: ...

    def from_rank0(self, fn: Callable[[], T], what: str = "", share: bool = True) -> T | None:
        """fn() on rank 0 and its result on every rank: how every rank learns what only rank 0 may read
        (the journal, the run directory). The result must be msgpack-encodable (share=False: it stays
        on rank 0, the others get None: a handle only rank 0 holds). A failure is raised on every rank,
        so none is left waiting: on rank 0 as it was, elsewhere as one sentence naming `what` failed."""
        result, error, failure = None, "", None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - raised again below, on every rank
                if self.world_size == 1:
                    raise
                error, failure = str(e) or type(e).__name__, e
        if self.world_size == 1:
            return result
        error = self.broadcast_obj(error)
        if error:
            if failure is not None:
                raise failure
            raise RunError(f"rank 0 failed{f' in {what}' if what else ''}: {error}")
        return self.broadcast_obj(result) if share else result

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of a tensor over the data-parallel ranks (TP peers hold the same one: counted once)."""
        if self.world_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t / self.tp_size if self.tp_size > 1 else t

    def max_over(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of a tensor over all ranks."""
        if self.world_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average metrics over ranks (fixed key order; float64 so the sum is exact for two ranks)."""
        if self.world_size == 1 or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.cpu().tolist())}


def teardown() -> None:
    """Destroy the process group while the interpreter is still whole. Left to interpreter exit, gloo's
    worker threads can free their last work's tensors during finalization, and the process dies of
    SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489) after its
    command has succeeded. A no-op when no group was started."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def prepare_accelerator() -> None:
    """Before DeepSpeed is imported: no GPU visible means its CPU accelerator, chosen quietly."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op when its comm layer starts
    (about 100 s on 2 cores, on every fresh machine, and it prints to stdout). Only
    ``inference_all_reduce`` (AutoTP's layers) uses the op, and without it DeepSpeed falls back to the
    process group's own all_reduce (gloo here), the same path every other collective takes."""
    import importlib

    # by module name: the package `deepspeed.comm` re-exports `torch` itself under that attribute
    comm: Any = importlib.import_module("deepspeed.comm.torch")
    comm.build_shm_op = lambda: None


def setup(cfg: Config) -> Runtime:
    """Initialise torch.distributed (gloo on CPU, NCCL on GPU) and pick the device."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:  # a plain process: a one-rank group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device is cuda but no CUDA device is visible; use trainer.device=cpu")
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = cfg.distributed.backend if cfg.distributed.backend != "auto" else ("nccl" if use_cuda else "gloo")
    tp = cfg.distributed.tensor_parallel_size
    if world % tp:
        raise ConfigError(f"distributed.tensor_parallel_size ({tp}) must divide the number of ranks ({world})")
    # DeepSpeed sets its logger to WARNING when it is imported, after the CLI quieted it: again, so its
    # warnings about what verlj handles itself (no model-parallel unit on a universal load) stay out
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if not dist.is_initialized():
        _skip_shm_comm_build()
        for attempt in range(5):
            try:
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
                break
            except dist.DistNetworkError as e:
                # a one-rank group's port (picked free, or inherited with WORLD_SIZE=1 from a process whose own group
                # holds it) taken before its store bound it: no other rank needs to agree on another
                if world != 1 or "EADDRINUSE" not in str(e) or attempt == 4:
                    raise
                os.environ["MASTER_PORT"] = str(_free_port())
    return Runtime(rank=rank, world_size=world, local_rank=local, tp_size=tp, device=device, backend=backend)


def configure_determinism(cfg: Config) -> None:
    """Fixed threads and deterministic kernels: the same inputs give the same bits."""
    torch.set_num_threads(cfg.trainer.num_threads)
    if cfg.trainer.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
