"""The agent gateway's cost per call: the same calls answered in-process and through the gateway (HTTP on
loopback, the `openai` client, the lockstep runner, the ledger), with generation itself taken out (a
generate function that returns fixed tokens at once), so the difference is what the gateway adds.

    python tools/bench_gateway.py                       # 16 episodes in flight, 8 calls each, 5 repeats
    python tools/bench_gateway.py --episodes 1 --calls 32

Prints, per arm, the median over repeats of the wall time per call and the calls per second, and the
gateway's added cost per call (the issue's goal: at most 2 ms a call at 16 concurrent episodes). The
in-process arm renders each prompt with the chat template, tokenizes it and builds the same response
bytes (gateway.protocol), without the server, the client or the threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openai

from verlj.engine.rl.gateway.protocol import parse_request, response_bytes
from verlj.engine.rl.gateway.runner import Runner
from verlj.engine.rl.gateway.server import Gateway
from verlj.engine.rl.models import builtin_tokenizer, render_chat
from verlj.engine.rl.vocab import VOCABS

TOK = builtin_tokenizer(VOCABS["ascii"])
ANSWER = np.asarray(TOK("42 is the answer", add_special_tokens=False).input_ids, np.int64)


def generate(prompts, seeds):
    return [ANSWER] * len(prompts), [np.full(len(ANSWER), -0.5, np.float32)] * len(prompts)


def make_agent(calls: int):
    def agent(ep):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": ep.row["prompt"]}]
        for _ in range(calls):
            got = client.chat.completions.create(model=ep.model, messages=msgs)
            msgs += [{"role": "assistant", "content": got.choices[0].message.content}, {"role": "user", "content": "go on"}]
        return 1.0
    return agent


def through_gateway(episodes: int, calls: int) -> float:
    gw = Gateway("bench").start()
    try:
        r = Runner(gw, make_agent(calls), TOK, lambda m, t: render_chat(TOK, m, True), generate, episodes, 60.0, calls)
        t = time.perf_counter()
        out = r.play([{"prompt": f"question {i}"} for i in range(episodes)], list(range(episodes)), lambda p, k: p * 1000 + k)
        took = time.perf_counter() - t
        assert all(not p.fault and len(p.calls) == calls for p in out), [p.fault for p in out]
        return took
    finally:
        gw.stop()


def in_process(episodes: int, calls: int) -> float:
    from verlj.engine.rl.gateway.protocol import Completion

    t = time.perf_counter()
    for i in range(episodes):
        msgs = [{"role": "user", "content": f"question {i}"}]
        for k in range(calls):
            req = parse_request(b'{"model": "bench", "messages": ' + __import__("json").dumps(msgs).encode() + b"}", "bench")
            ids = TOK(render_chat(TOK, req.messages, True), add_special_tokens=False).input_ids
            out, lps = generate([ids], [k])
            text = TOK.decode(out[0], skip_special_tokens=True)
            body, _ = response_bytes(req, Completion(text, [], lps[0].tolist(), "length", len(ids), len(out[0])), f"{k}")
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    n = a.episodes * a.calls
    gw = statistics.median(through_gateway(a.episodes, a.calls) for _ in range(a.repeats))
    ip = statistics.median(in_process(a.episodes, a.calls) for _ in range(a.repeats))
    print(f"{a.episodes} episodes in flight x {a.calls} calls = {n} calls, median of {a.repeats}")
    print(f"  in-process  {1e3 * ip / n:8.3f} ms/call  {n / ip:9.1f} calls/s")
    print(f"  gateway     {1e3 * gw / n:8.3f} ms/call  {n / gw:9.1f} calls/s")
    print(f"  added       {1e3 * (gw - ip) / n:8.3f} ms/call  (gateway/in-process {gw / ip:.1f}x)")


if __name__ == "__main__":
    main()
