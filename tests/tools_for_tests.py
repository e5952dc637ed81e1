"""Tools for the tests of rollout.tools (rl.gateway.tools): services outside the episode that append every effect they apply to
the file VERLJ_TEST_EFFECTS (one JSON line each, fsynced), as an outside world would see them. They run in the trainer's
process, so a SIGKILL can tear the line being written: a torn line is an effect never applied (skipped when read; the next
line begins on a line of its own).

open_ticket honours idempotency keys (a key applied before is answered with its first result, the re-send written as
``dedup``) and offers a reconcile (the result stored under a key, None when none is); post_message honours nothing and offers
no reconcile."""

from __future__ import annotations

import json
import os

from verlj.engine.rl.gateway.tools import tool


def _effects() -> list[dict]:
    path = os.environ["VERLJ_TEST_EFFECTS"]
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line torn by a SIGKILL mid-write (the trainer's process runs these services): never applied
                continue
    return out


def _append(entry: dict) -> None:
    with open(os.environ["VERLJ_TEST_EFFECTS"], "a+b") as f:
        f.seek(0, os.SEEK_END)
        torn = False  # a line a kill tore mid-write: ended first, left unparsable (never applied)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(entry).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def ticket_by_key(key: str, arguments: dict) -> str | None:
    return next((e["result"] for e in _effects() if e["key"] == key and e["kind"] == "applied"), None)


@tool(effect="external", reconcile=ticket_by_key)
def open_ticket(title: str, idempotency_key: str) -> str:
    """Open a ticket titled `title`."""
    done = ticket_by_key(idempotency_key, {})
    if done is not None:
        _append({"key": idempotency_key, "kind": "dedup", "result": done})
        return done
    result = f"ticket opened: {title[:16]}"
    _append({"key": idempotency_key, "kind": "applied", "result": result})
    return result


@tool(effect="external")
def post_message(title: str, idempotency_key: str) -> str:
    """Post `title` to a channel that keeps no keys."""
    result = f"posted: {title[:16]}"
    _append({"key": idempotency_key, "kind": "applied", "result": result})
    return result
