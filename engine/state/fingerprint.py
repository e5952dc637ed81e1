"""The fingerprint of a run's trained state: a digest of every rank's parameters, optimizer and
LR-scheduler state, in a fixed order. Journaled after every step; replay must reproduce it bit for bit.

Two kinds (``trainer.state_digest``, fixed for a run; runs made before the key are ``blake3``):

- ``sum64`` (the default): computed where the tensors live, with torch reductions, so only 16
  bytes per tensor leave the device. Each tensor's bytes are read as int64 words (the bytes past
  the last whole word make one more), laid out as rows of ``ROW`` words, and reduced twice:
  Σ_r (r+1)·rowsum_r and Σ_c (c+1)·colsum_c. Integer sums wrap modulo 2^64, which is associative,
  so the result is the same bits on any device and in any reduction order. Any change of one word
  changes it, and so does an exchange of two different words (two rows' sums change, or, within a
  row, two columns').
  It is a checksum for telling states apart, not a cryptographic hash: the journal's chain and the
  snapshot manifests stay BLAKE3. The host then hashes these sums with the tensors' names, dtypes
  and shapes with BLAKE3.
- ``blake3``: every tensor copied to host memory and hashed whole (what verlj did before sum64).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import blake3
import torch

from ..dist import Runtime

SMALL = 1 << 20  # tensors under this many bytes are digested together (one row of sums for all of them) ...
CHUNK = 4 << 20  # ... gathered into buffers of at most this many bytes (group_sums)
ROW = 16  # int64 words per row of the sum64 layout (128 bytes: both reductions stream at memory speed on CPU)
PIECE = 1 << 20  # a large tensor is reduced in pieces of at most this many words (8 MiB), on as many threads ...
MAX_THREADS = 8  # ... as the process may run on, at most this many


# ----------------------------------------------------------------------------- sum64


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of int64 words, and the bytes past the last whole word
    as one more word (zero-padded). No copy when the tensor is contiguous and 8-byte aligned."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a view into a flat buffer at an offset that is not 8-byte aligned
        words = raw[:whole].clone().view(torch.int64)
    if whole < raw.numel():
        rest = raw[whole:].to(torch.int64)
        last = (rest << (8 * torch.arange(rest.numel(), device=rest.device, dtype=torch.int64))).sum().reshape(1)
        words = torch.cat([words, last])
    return words


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """The sum64 digest of one tensor: int64 [2] on the tensor's device (see the module's doc)."""
    w = _words(t)
    n = w.numel()
    rows = n // ROW
    out = torch.zeros(2, dtype=torch.int64, device=w.device)
    if rows:
        main = w[: rows * ROW].view(rows, ROW)
        out[0] += (main.sum(1) * torch.arange(1, rows + 1, dtype=torch.int64, device=w.device)).sum()
        out[1] += (main.sum(0) * torch.arange(1, ROW + 1, dtype=torch.int64, device=w.device)).sum()
    if n > rows * ROW:
        tail = w[rows * ROW :]
        out[0] += (tail * torch.arange(rows * ROW + 1, n + 1, dtype=torch.int64, device=w.device)).sum()
        out[1] += tail.sum()
    return out


def group_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum64 of many tensors of one device, [k, 2]: the small ones as if concatenated (first), then
    each large one (no copy of a large one).

    The small ones' row is tensor_sums of their words laid end to end, but that layout is never
    built whole (on a model whose every tensor is small, that copied its whole state each step, and
    a fresh buffer of it costs more than the copy): they are gathered at most CHUNK bytes at a time,
    and each chunk adds its share at its place in the layout (_placed_sums; the sums are linear
    modulo 2^64, so the row is the same bits). One set of kernels still serves many small tensors.
    A large tensor is reduced in pieces of at most PIECE words the same way, and on the host the
    pieces and chunks are reduced by as many threads as the process may use (torch releases the
    interpreter's lock in its kernels): integer sums modulo 2^64 are the same bits in any order."""
    small = [_words(t) for t in tensors if t.numel() * t.element_size() < SMALL]
    jobs: list[tuple[int, list[torch.Tensor], int, int]] = []  # (row of the result, words laid end to end, offset, end)
    if small:
        end = sum(w.numel() for w in small) // ROW * ROW  # the layout's rows end here; the words past it are its tail
        offset, held = 0, 0
        chunk: list[torch.Tensor] = []
        for w in [*small, None]:
            if chunk and (w is None or (held + w.numel()) * 8 > CHUNK):
                jobs.append((0, chunk, offset, end))
                offset, chunk, held = offset + held, [], 0
            if w is not None:
                chunk.append(w)
                held += w.numel()
    rows = int(bool(small))
    for t in tensors:
        if t.numel() * t.element_size() >= SMALL:
            w = _words(t)
            jobs += [(rows, [w[lo : lo + PIECE]], lo, w.numel() // ROW * ROW) for lo in range(0, w.numel(), PIECE)]
            rows += 1
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64)
    device = tensors[0].device
    out = torch.zeros((rows, 2), dtype=torch.int64, device=device)
    for (row, _, _, _), share in zip(jobs, _in_parallel(_job, jobs, device)):
        out[row] += share
    return out


def _job(job: tuple[int, list[torch.Tensor], int, int]) -> torch.Tensor:
    _, words, offset, end = job
    return _placed_sums(torch.cat(words) if len(words) > 1 else words[0], offset, end)


def _in_parallel(fn, jobs: list, device: torch.device) -> list:
    """[fn(job) for job in jobs], on a host's tensors by a pool of threads (one a core this process may
    run on, at most MAX_THREADS), made for the call: a pool kept across calls would not survive a fork."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # macOS has no affinity
    threads = min(cores, MAX_THREADS, len(jobs)) if device.type == "cpu" else 1
    if threads <= 1:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(threads, thread_name_prefix="verlj-digest") as pool:
        return list(pool.map(fn, jobs))


def _placed_sums(w: torch.Tensor, offset: int, end: int) -> torch.Tensor:
    """The share of words `w` in tensor_sums of a layout that holds them at [offset, offset + len),
    whose rows end at `end` (a multiple of ROW; the words past it are the layout's tail): int64 [2].
    Whole rows are reduced as rows, in place; the few words before the first and after the last
    whole row, and the tail's, with their weights spelled out."""
    dev, m = w.device, w.numel()
    s0, s1 = [], []
    main = min(offset + m, end)
    if offset < main:
        first = min(main, -(-offset // ROW) * ROW)  # the first row boundary at or after offset
        last = max(first, main // ROW * ROW)  # the last row boundary at or before main
        for lo, hi in ((offset, first), (last, main)):  # part rows: weights row+1 and column+1
            if hi > lo:
                part, j = w[lo - offset : hi - offset], torch.arange(lo, hi, dtype=torch.int64, device=dev)
                s0.append((part * (j // ROW + 1)).sum())
                s1.append((part * (j % ROW + 1)).sum())
        if last > first:  # rows r0.. weigh r0 + 1 + j: r0 times their sum, plus weights 1.. made once
            rows = w[first - offset : last - offset].view(-1, ROW)
            sums = rows.sum(1)
            s0.append(_weighted(sums, _rows(dev, rows.shape[0])) + first // ROW * sums.sum())
            s1.append(_weighted(rows.sum(0), _columns(dev)))
    if offset + m > end:  # the layout's tail: weights position+1 and 1
        lo = max(offset, end)
        tail = w[lo - offset :]
        s0.append((tail * torch.arange(lo + 1, offset + m + 1, dtype=torch.int64, device=dev)).sum())
        s1.append(tail.sum())
    return torch.stack([sum(s0), sum(s1)])


@functools.cache
def _columns(dev: torch.device) -> torch.Tensor:
    """The column weights 1..ROW on a device, made once."""
    return torch.arange(1, ROW + 1, dtype=torch.int64, device=dev)


@functools.cache
def _row_weights(dev: torch.device) -> torch.Tensor:
    """The row weights 1..(rows of a piece) on a device, made once."""
    return torch.arange(1, max(PIECE, CHUNK // 8) // ROW + 1, dtype=torch.int64, device=dev)


def _rows(dev: torch.device, n: int) -> torch.Tensor:
    """The row weights 1..n."""
    made = _row_weights(dev)
    return made[:n] if n <= made.numel() else torch.arange(1, n + 1, dtype=torch.int64, device=dev)


def _weighted(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ x·weights modulo 2^64: on the host one kernel without a temporary (CUDA has no integer dot)."""
    return torch.dot(x, weights) if x.device.type == "cpu" else (x * weights).sum()


# ----------------------------------------------------------------------------- traversal


def _leaves(obj, path: str, out: list) -> None:
    """(path, tensor or scalar) of every leaf of a nested state, dicts in sorted key order."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _leaves(obj[k], f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}/{i}", out)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out.append((path, obj))
    # other objects (enums, configs inside optimizer states) do not carry training state


def state_leaves(engine) -> list:
    """This rank's share of an engine's state, as (path, leaf): parameters (ZeRO-3 partitions),
    optimizer, LR scheduler, step count. Frozen parameters (a LoRA run's base) are left out: they
    never change, and the run's identity names them by their digest."""
    out: list = []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        _leaves(p.ds_tensor if hasattr(p, "ds_tensor") else p, "param/" + name, out)
    _leaves(engine.optimizer.state_dict(), "optim", out)
    if engine.lr_scheduler is not None:
        _leaves(engine.lr_scheduler.state_dict(), "sched", out)
    out.append(("global_steps", engine.global_steps))
    return out


def leaves_digest(leaves: list, kind: str) -> str:
    h = blake3.blake3()
    if kind == "blake3":
        for path, v in leaves:
            if isinstance(v, torch.Tensor):
                t = v.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(_scalar(path, v))
        return h.hexdigest()
    # the small tensors of a device are digested as one concatenation (computed without building it:
    # group_sums); the large ones one by one, without a copy. Names, dtypes and shapes are hashed
    # on the host, so where one small tensor ends and the next begins is part of the digest.
    by_device: dict = {}
    for path, v in leaves:
        if isinstance(v, torch.Tensor):
            h.update(f"{path}:{v.dtype}:{tuple(v.shape)}".encode())
            by_device.setdefault(v.device, []).append(v)
        else:
            h.update(_scalar(path, v))
    for dev in sorted(by_device, key=str):  # 16 bytes a large tensor (and one pair for the small ones) leave each device
        h.update(f"{dev.type}".encode())
        h.update(group_sums(by_device[dev]).cpu().numpy().tobytes())
    return h.hexdigest()


def _scalar(path: str, v) -> bytes:
    return (f"global_steps={v}" if path == "global_steps" else f"{path}={v!r}").encode()


def engine_digest(engine, kind: str = "sum64") -> str:
    """This rank's share of an engine's state, digested (`kind`: see the module's doc)."""
    return leaves_digest(state_leaves(engine), kind)


def state_fingerprint(engines: dict[str, object], rt: Runtime, kind: str = "sum64") -> tuple[str, dict[str, str]]:
    """A digest of the whole trained state across ranks: (fingerprint, {part: digest})."""
    local = {name: engine_digest(e, kind) for name, e in engines.items()}
    per_rank = rt.all_gather_obj(local)
    parts = {name: blake3.blake3("|".join(r[name] for r in per_rank).encode()).hexdigest() for name in engines}
    fp = blake3.blake3("|".join(f"{k}={parts[k]}" for k in sorted(parts)).encode()).hexdigest()
    return fp, parts
