"""LoRA against a full fine-tune of the same model, side by side in one process: snapshot bytes,
snapshot write time, step time.

    python tools/bench_lora.py                    # the ~50M-parameter built-in model, rank 8, 4 steps each
    python tools/bench_lora.py --size tiny --rank 4

For each of the two runs (same model, same seed; the LoRA one with model.actor.lora_rank): train
--steps steps (collect and apply, as the loop does), then write --writes snapshots of the state
(Checkpointer.write_standalone: DeepSpeed's files, anchor, manifest, fsynced) and measure each
one's bytes and time. Prints medians and the LoRA / full ratios. Absolute times on a shared 2-core
machine mean little; the ratios are the result.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

COMMON = ["data.prompts_per_step=2", "rollout.n=2", "rollout.max_response_length=8", "model.actor.micro_batch_size=4",
          "logging.progress=lines", "distributed.zero_stage=0"]
SIZES = {
    "tiny": [],
    "50M": ["model.tiny.hidden_size=512", "model.tiny.num_layers=16", "model.tiny.intermediate_size=1408",
            "model.tiny.num_heads=8"],
}


def measure(label: str, over: list[str], steps: int, writes: int, root: Path) -> dict:
    from verlj.engine.config import make_config
    from verlj.engine.dist import configure_determinism, setup
    from verlj.engine.loop.checkpointer import make_run
    from verlj.engine.report import Reporter
    from verlj.engine.rl.trainer import Trainer

    cfg = make_config(None, [*COMMON, *over])
    rt = setup(cfg)
    configure_determinism(cfg)
    trainer = Trainer(cfg, rt)
    run = make_run(root / label, rt, trainer, Reporter(cfg.logging, root / label, enabled=False, total_steps=steps, sinks=False))
    step_s = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        inputs = run.source.collect(step)
        trainer.apply(step, inputs, trainer.take(step, inputs))
        run.source.weights_changed()
        step_s.append(time.perf_counter() - t)
    fp, _ = trainer.state_fingerprint()
    write_s, sizes = [], []
    for k in range(writes):
        out = root / f"{label}-snapshot{k}"
        t = time.perf_counter()
        run.ckpt.write_standalone(steps, fp, out)
        write_s.append(time.perf_counter() - t)
        sizes.append(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
        shutil.rmtree(out)
    trained = sum(p.numel() for p in trainer.actor.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.actor.module.parameters())
    run.source.close()
    trainer.close()
    return {"label": label, "trained": trained, "total": total, "bytes": statistics.median(sizes),
            "write_s": statistics.median(write_s), "step_s": statistics.median(step_s[1:] or step_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="50M", choices=sorted(SIZES))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--writes", type=int, default=3)
    args = ap.parse_args()
    over = [*SIZES[args.size], f"trainer.total_steps={args.steps}"]
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        full = measure("full", over, args.steps, args.writes, Path(tmp))
        lora = measure("lora", [*over, f"model.actor.lora_rank={args.rank}", f"model.actor.lora_alpha={2 * args.rank}"],
                       args.steps, args.writes, Path(tmp))
    print(f"model: {full['total'] / 1e6:.1f}M parameters ({args.size}); LoRA rank {args.rank} on all-linear trains "
          f"{lora['trained'] / 1e6:.2f}M ({lora['trained'] / full['total']:.2%})")
    print(f"{'':<8}{'snapshot bytes':>16}{'write (s)':>12}{'step (s)':>11}")
    for r in (full, lora):
        print(f"{r['label']:<8}{r['bytes'] / 1e6:>14.2f}MB{r['write_s']:>12.3f}{r['step_s']:>11.3f}")
    print(f"{'lora/full':<8}{lora['bytes'] / full['bytes']:>16.3f}{lora['write_s'] / full['write_s']:>12.3f}"
          f"{lora['step_s'] / full['step_s']:>11.3f}")


if __name__ == "__main__":
    main()
