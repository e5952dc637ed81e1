"""Journal append benchmark: the journal against the floor of raw LMDB puts, measured side by side.

    python tools/bench_journal.py                 # full run (~2-3 min, ~2 GB scratch disk)
    python tools/bench_journal.py --steps 100 --growth-steps 5000 --large-steps 3   # quick look

What it prints (all measured in this one run):
  - per-step commit latency (median, p99), records/s and bytes per step for realistic step records
    (64 samples x 256 tokens as the engine journals them: padded int32 token ids drawn from a Zipf
    law over a 32k vocabulary, float32 log-probs of the sampled and reference policies, rewards,
    40 metrics), fsynced commits;
  - the floor: raw LMDB puts of the very same stored bytes with the same sync setting, no encoding,
    compression or hashing, interleaved with the journal's appends so both see the same disk weather;
    the ratio journal/floor;
  - a large step (1,024 samples x 2,048 tokens by default): commit time against the floor, bytes per
    generated token as stored now (payload compressed, integers narrowed) and as the v1 format stored
    them (everything inline), and the payload's compression ratio, at zstd levels 1 and 3;
  - growth: append latency near step 1,000 against near step 100,000 (goal <= 1.2). The journal is
    filled to there with append_steps (1,000 steps per transaction) using medium records, then single
    fsynced appends are timed at both depths;
  - multi-turn episodes (rollout.env): bytes per step and per turn of steps whose samples are episodes
    (4 turns of 64 action + 32 observation tokens by default, with loss_mask, turn_lens, turn_rewards and
    the env fields, packed by engine.schema.sample.pack as the trainer packs them), stored (the journal's
    frame: compact core, zstd payload) and raw (the same events as plain msgpack), side by side with
    single-turn steps of the same samples and response tokens. `--only turns` runs this part alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from verlj.engine.schema.sample import EnvEnd, Sample, pack
from verlj.journal import Journal, make_event, packb
from verlj.journal.codec import Shapes
from verlj.journal.events import summary_types
from verlj.journal.frames import StepFrame, encode_step, frame_plain, frame_step, frame_step2, step_key


def samples_columns(rng: np.random.Generator, samples: int, tokens: int, prompt: int = 64, vocab: int = 32000) -> dict:
    """A step's samples as the engine journals them (engine.schema.sample.pack's columns)."""
    def ids(n, width):
        lens = rng.integers(width // 4, width + 1, n).astype(np.int32)
        arr = np.full((n, width), -1, np.int32)
        mask = np.arange(width)[None, :] < lens[:, None]
        arr[mask] = np.minimum(rng.zipf(1.2, int(lens.sum())), vocab) - 1
        return arr, lens, mask

    p, plen, _ = ids(samples, prompt)
    r, rlen, mask = ids(samples, tokens)
    confident = rng.random(r.shape) < 0.6  # most sampled tokens are near-certain; the rest spread out
    gen = np.where(confident, -rng.uniform(0, 0.05, r.shape), -rng.exponential(2.0, r.shape)).astype(np.float32) * mask
    ref = (gen + rng.normal(0, 0.05, r.shape).astype(np.float32) * mask).astype(np.float32)
    base = np.arange(samples, dtype=np.int64)
    return {"id": base, "index": base // 8, "group": base - base % 8, "score": rng.random(samples),
            "rule_reward": rng.random(samples), "rm_score": np.zeros(samples),
            "prompt_ids": p, "prompt_ids_len": plen, "response_ids": r, "response_ids_len": rlen,
            "gen_logprobs": gen, "gen_logprobs_len": rlen, "ref_logprobs": ref, "ref_logprobs_len": rlen}


def step_events(step: int, rng: np.random.Generator, samples: int, tokens: int) -> list[dict]:
    cols = samples_columns(rng, samples, tokens)
    ids = cols["id"] + step * samples
    cols["id"] = ids
    return [
        make_event("data", epoch=0, cursor=step * 8, indices=np.arange(8, dtype=np.int64) + step * 8),
        make_event("rng", seeds={"data": step, "rollout": step + 1, "train": step + 2}),
        make_event("buffer.add", ids=ids, samples=cols),
        make_event("buffer.consume", ids=ids),
        make_event("metrics", values={f"actor/metric_{i}": float(rng.standard_normal()) for i in range(40)}),
        make_event("state", fingerprint=rng.bytes(32).hex()),
    ]


def stored(step: int, events: list[dict], level: int, shapes: Shapes) -> bytes:
    """The bytes the journal stores for a step (its frame; the core is also its summary), built the way it builds them
    (`shapes`: the run's interned core shapes, one table for all its steps)."""
    core, payload = encode_step(step, 0.0, events, level, shapes)
    return frame_step2(core, payload, bytes(32))


def v1_bytes(step: int, events: list[dict]) -> int:
    """What the v1 format stored for the same step (everything inline, plain msgpack) and its summary."""
    body = packb({"v": 1, "step": step, "time": 0.0, "events": events})
    summary = frame_plain(packb({"step": step, "time": 0.0, "events": [e for e in events if e["type"] in summary_types()]}))
    return len(frame_step(body, bytes(32))) + len(summary)


def tokens_of(events: list[dict]) -> int:
    add = next(e for e in events if e["type"] == "buffer.add")
    return int(add["samples"]["response_ids_len"].sum())


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_vs_floor(root: Path, steps: int, samples: int, tokens: int, level: int = 1, label: str = "records") -> None:
    rng = np.random.default_rng(0)
    records = [step_events(s, rng, samples, tokens) for s in range(1, steps + 1)]
    jpath, fpath = root / f"journal-{label}-{level}", root / f"floor-{label}-{level}"
    journal = Journal.open_writer(jpath, compression_level=level)
    floor_env = lmdb.open(str(fpath), map_size=1 << 36, max_dbs=4, subdir=True)  # same flags: sync on
    floor_db = floor_env.open_db(b"steps")
    j_times, f_times, sizes, old_sizes, ntok, raw_payload, payload = [], [], [], [], 0, 0, 0
    shapes = Shapes()
    for s, events in enumerate(records, start=1):
        # The floor writes the bytes the journal stores for this step; building them here is not timed.
        raw = stored(s, events, level, shapes)
        sizes.append(len(raw))
        old_sizes.append(v1_bytes(s, events))
        ntok += tokens_of(events)
        frame = StepFrame.parse(raw)
        payload += len(frame.payload)
        raw_payload += len(packb(next(e for e in events if e["type"] == "buffer.add")["samples"]))

        def floor_put():
            t = time.perf_counter()
            with floor_env.begin(write=True) as txn:
                txn.put(step_key(s), raw, db=floor_db, append=True)
            f_times.append(time.perf_counter() - t)

        def journal_append():
            t = time.perf_counter()
            journal.writer.append_step(s, events)
            j_times.append(time.perf_counter() - t)

        # alternate who goes first so neither always follows the other's fsync
        for fn in (floor_put, journal_append) if s % 2 else (journal_append, floor_put):
            fn()
    journal.close()
    floor_env.close()
    jm, fm = statistics.median(j_times), statistics.median(f_times)
    print(f"{label}: {steps} steps of {samples} samples x {tokens} tokens (zstd level {level}), "
          f"{statistics.mean(sizes) / 1024:.1f} KiB/step stored (v1 format: {statistics.mean(old_sizes) / 1024:.1f} KiB)")
    print(f"  bytes per generated token: {sum(sizes) / ntok:.2f} (v1 format: {sum(old_sizes) / ntok:.2f}); "
          f"samples compressed {raw_payload / payload:.2f}x against plain msgpack")
    print(f"  journal append: median {jm * 1e3:.2f} ms, p99 {pct(j_times, 0.99) * 1e3:.2f} ms, {steps / sum(j_times):.1f} records/s")
    print(f"  raw LMDB floor: median {fm * 1e3:.2f} ms, p99 {pct(f_times, 0.99) * 1e3:.2f} ms (same stored bytes, fsynced)")
    print(f"  ratio journal/floor: median {jm / fm:.2f}x, total {sum(j_times) / sum(f_times):.2f}x")
    shutil.rmtree(jpath, ignore_errors=True)
    shutil.rmtree(fpath, ignore_errors=True)


def bench_growth(root: Path, far: int, samples: int, tokens: int, probes: int) -> None:
    """Append latency near step 1,000 and near step `far`, for the journal and for raw LMDB puts alike."""
    rng = np.random.default_rng(1)
    template = step_events(1, rng, samples, tokens)
    journal = Journal.open_writer(root / "growth")
    raw_value = None
    floor_env = lmdb.open(str(root / "growth-floor"), map_size=1 << 34, max_dbs=4, subdir=True)
    floor_db = floor_env.open_db(b"steps")

    def journal_put(s: int) -> None:
        journal.writer.append_step(s, template)

    def floor_put(s: int) -> None:
        with floor_env.begin(write=True) as txn:
            txn.put(step_key(s), raw_value, db=floor_db, append=True)

    def journal_fill(a: int, b: int) -> None:
        journal.writer.append_steps([(k, template) for k in range(a, b)])

    def floor_fill(a: int, b: int) -> None:
        with floor_env.begin(write=True) as txn:
            for k in range(a, b):
                txn.put(step_key(k), raw_value, db=floor_db, append=True)

    journal_put(1)
    raw_value = journal.read_raw(1)
    floor_put(1)
    last = {"journal": 1, "floor": 1}

    def fill_to(name, fill, target):
        s = last[name] + 1
        while s <= target:
            n = min(1000, target - s + 1)
            fill(s, s + n)
            s += n
        last[name] = target

    def probe(name, put, at):
        out = []
        for s in range(at, at + probes):
            t0 = time.perf_counter()
            put(s)
            out.append(time.perf_counter() - t0)
        last[name] = at + probes - 1
        return statistics.median(out)

    results = {}
    for at in (1000, far):
        for name, fill, put in (("journal", journal_fill, journal_put), ("floor", floor_fill, floor_put)):
            fill_to(name, fill, at - 1)
            os.sync()  # let the fill's writeback finish so every probe starts from a quiet disk
            time.sleep(1.0)
            results[(name, at)] = probe(name, put, at)
    size = (root / "growth" / "data.mdb").stat().st_size
    journal.close()
    floor_env.close()
    for name in ("journal", "floor"):
        a, b = results[(name, 1000)], results[(name, far)]
        print(f"growth {name:7s}: median append at step 1,000 {a * 1e3:.2f} ms, at step {far:,} {b * 1e3:.2f} ms -> {b / a:.2f}x")
    jg = results[("journal", far)] / results[("journal", 1000)]
    fg = results[("floor", far)] / results[("floor", 1000)]
    print(f"growth ratio: journal {jg:.2f}x (goal <= 1.2), raw LMDB {fg:.2f}x on the same disk; "
          f"journal's own share {jg / fg:.2f}x; journal {size / 2**30:.2f} GiB")


EPISODES, MASKED, SINGLE = "episodes", "masked", "single-turn"


def episode_columns(rng: np.random.Generator, samples: int, turns: int, action: int, observation: int, kind: str,
                    prompt: int = 64, vocab: int = 32000) -> dict:
    """A step's samples through schema.sample.pack, as the trainer journals them. EPISODES: each sample
    `turns` turns of `action` policy tokens then `observation` env tokens, generation log-probs 0 on the
    env's (the env's reward on the last turn only, NaN before; the episode ended at max_turns). SINGLE:
    the same tokens as one response, every token the policy's. MASKED: the episodes' tokens and log-probs
    without the episode columns (what those columns alone cost). Token ids Zipf over `vocab`; log-probs
    as samples_columns'; the reference's on every response token."""
    width = turns * (action + observation)
    out = []
    for i in range(samples):
        ids = np.minimum(rng.zipf(1.2, width), vocab) - 1
        mask = np.tile(np.r_[np.ones(action, np.int8), np.zeros(observation, np.int8)], turns)
        confident = rng.random(width) < 0.6
        gen = np.where(confident, -rng.uniform(0, 0.05, width), -rng.exponential(2.0, width)).astype(np.float32)
        ref = (gen + rng.normal(0, 0.05, width)).astype(np.float32)
        seed = int(rng.integers(0, 2**63 - 1))  # drawn for every kind: each kind sees the same draws
        s = Sample(index=i // 8, prompt_ids=np.minimum(rng.zipf(1.2, prompt), vocab) - 1, response_ids=ids, id=i, group=i - i % 8,
                   score=float(rng.random()), rule_reward=float(rng.random()), policy_version=0, ref_logprobs=ref,
                   gen_logprobs=gen if kind == SINGLE else gen * mask)
        if kind == EPISODES:
            s.loss_mask, s.turn_lens = mask, np.tile([action, observation], turns)
            s.turn_rewards = np.r_[np.full(turns - 1, np.nan), s.score]
            s.env_seed, s.env_end = seed, EnvEnd.MAX_TURNS
        out.append(s)
    return pack(out)


def bench_turns(steps: int, samples: int, turns: int, action: int, observation: int, level: int = 1) -> None:
    """Bytes per step and per turn, stored and raw, of steps of episodes against single-turn steps of the same tokens."""
    sizes: dict[str, tuple[float, float]] = {}
    for kind in (EPISODES, MASKED, SINGLE):
        rng, shapes = np.random.default_rng(2), Shapes()  # the same draws for each kind
        stored_b = raw_b = 0
        for s in range(1, steps + 1):
            cols = episode_columns(rng, samples, turns, action, observation, kind)
            events = step_events(s, rng, samples, 0)
            events[2] = make_event("buffer.add", ids=cols["id"], samples=cols)
            stored_b += len(stored(s, events, level, shapes))
            raw_b += len(packb(events))
        sizes[kind] = (stored_b / steps, raw_b / steps)
    (es, er), (ms, mr), (ss, sr) = sizes[EPISODES], sizes[MASKED], sizes[SINGLE]
    per, tokens = samples * turns, samples * turns * (action + observation)
    print(f"multi-turn: {steps} steps of {samples} episodes x {turns} turns of {action} action + {observation} observation tokens "
          f"(zstd level {level}), against {samples} single-turn samples x {turns * (action + observation)} tokens a step")
    print(f"  episodes:    stored {es / 1024:.1f} KiB/step, {es / per:.0f} bytes/turn, {es / tokens:.2f} bytes/token; "
          f"raw {er / 1024:.1f} KiB/step, {er / per:.0f} bytes/turn")
    print(f"  single-turn: stored {ss / 1024:.1f} KiB/step, {ss / samples:.0f} bytes/sample, {ss / tokens:.2f} bytes/token; "
          f"raw {sr / 1024:.1f} KiB/step, {sr / samples:.0f} bytes/sample")
    print(f"  episodes/single-turn: stored {es / ss:.3f}x, raw {er / sr:.3f}x (an episode's observation tokens carry no "
          "generation log-prob: 0, which compresses)")
    print(f"  the episode columns alone (loss_mask, turn_lens, turn_rewards, env_seed, env_end, env_reason): "
          f"{(es - ms) / per:.1f} bytes/turn stored, {(er - mr) / per:.1f} raw ({(es - ms) / es:.1%} of the stored step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--growth-steps", type=int, default=100_000)
    ap.add_argument("--growth-samples", type=int, default=8)
    ap.add_argument("--growth-tokens", type=int, default=128)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--large-steps", type=int, default=6, help="large steps timed per zstd level (0 skips)")
    ap.add_argument("--large-samples", type=int, default=1024)
    ap.add_argument("--large-tokens", type=int, default=2048)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--turn-steps", type=int, default=20, help="steps of episodes (and of single-turn samples) measured")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--action-tokens", type=int, default=64)
    ap.add_argument("--observation-tokens", type=int, default=32)
    ap.add_argument("--only", choices=["all", "turns"], default="all", help="turns: the multi-turn bytes alone (no disk, ~1 min)")
    args = ap.parse_args()
    bench_turns(args.turn_steps, args.samples, args.turns, args.action_tokens, args.observation_tokens)
    if args.only == "turns":
        return
    root = Path(tempfile.mkdtemp(prefix="verlj-bench-", dir=args.dir))
    try:
        bench_vs_floor(root, args.steps, args.samples, args.tokens)
        for level in (1, 3) if args.large_steps else ():  # 1 is the default
            bench_vs_floor(root, args.large_steps, args.large_samples, args.large_tokens, level, "large step")
        bench_growth(root, args.growth_steps, args.growth_samples, args.growth_tokens, args.probes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
