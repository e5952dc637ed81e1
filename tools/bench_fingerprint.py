"""The per-step state digest's throughput, side by side in one process: sum64 (verlj's default:
position-weighted int64 sums where the tensors live) against a plain ``torch.sum`` over the same
tensors (the memory-bandwidth floor: one read of every byte) and against the blake3 path (every
tensor copied to host memory and hashed, verlj's digest before sum64).

    python tools/bench_fingerprint.py                     # 0.1M, 20M and 200M parameters, on CPU (~2 min)
    python tools/bench_fingerprint.py --device cuda       # on a GPU
    python tools/bench_fingerprint.py --params 256x8x688  # hidden 256, 8 layers, MLP 688 wide: every tensor under 1 MiB

The state is shaped like a model's with AdamW: each parameter with its exp_avg and exp_avg_sq, fp32
(a Llama-like set of matrices), so 12 bytes of state per parameter. Each measurement is the median
of --repeats, the three methods interleaved. Prints GB of state per second and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def state(params: int, device: str, shape: tuple[int, int, int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) leaves of a Llama-like parameter set of about `params` parameters, with AdamW's
    state; or of `shape` (hidden, layers, MLP width)."""
    if shape is None:
        hidden = max(16, int((params / 12) ** 0.5) // 16 * 16)  # one layer ~ 12 h^2 (attention 4 h^2, MLP 8 h^2)
        layers, mlp = max(1, round(params / (12 * hidden * hidden))), 4 * hidden
    else:
        hidden, layers, mlp = shape
    shapes = []
    for i in range(layers):
        shapes += [(f"layers.{i}.attn.{k}", (hidden, hidden)) for k in ("q", "k", "v", "o")]
        shapes += [(f"layers.{i}.mlp.{k}", (mlp, hidden) if k != "down" else (hidden, mlp)) for k in ("gate", "up", "down")]
        shapes += [(f"layers.{i}.norm", (hidden,))]
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for name, shape in shapes:
        for part in ("param", "exp_avg", "exp_avg_sq"):
            out.append((f"{part}/{name}", torch.randn(shape, generator=g).to(device)))
    return out


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="0.1M,20M,200M", help="sizes: a parameter count (20M), or HIDDENxLAYERSxMLP (256x8x688)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the trainer's default is 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verlj.engine.state.fingerprint import leaves_digest

    print(f"device {args.device}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'params':>8} {'state':>9} | {'floor GB/s':>10} {'sum64 GB/s':>10} {'blake3 GB/s':>11} | {'sum64/floor':>11} {'sum64/blake3':>12}")
    for spec in args.params.split(","):
        if "x" in spec:
            leaves = state(0, args.device, tuple(int(x) for x in spec.split("x")))
        else:
            leaves = state(int(float(spec.rstrip("MK")) * {"M": 1e6, "K": 1e3}.get(spec[-1], 1)), args.device)
        tensors = [t for _, t in leaves]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        methods = {
            "floor": lambda ts=tensors: [t.sum() for t in ts] and None,
            "sum64": lambda ls=leaves: leaves_digest(ls, "sum64"),
            "blake3": lambda ls=leaves: leaves_digest(ls, "blake3"),
        }
        for fn in methods.values():  # warm up (allocator, cached weights)
            timed(fn, args.device)
        times = {k: [] for k in methods}
        for _ in range(args.repeats):
            for k, fn in methods.items():
                times[k].append(timed(fn, args.device))
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        print(f"{spec:>8} {nbytes / 2**20:>7.0f}MiB | {gbs['floor']:>10.2f} {gbs['sum64']:>10.2f} {gbs['blake3']:>11.2f} | "
              f"{gbs['sum64'] / gbs['floor']:>11.2f} {gbs['sum64'] / gbs['blake3']:>12.2f}")
        methods.clear()
        leaves = tensors = []  # free this size's state before the next


if __name__ == "__main__":
    main()
