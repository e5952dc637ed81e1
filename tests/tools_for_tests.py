"""Tools for the tests of rollout.tools (rl.gateway.tools): services outside the episode that append every effect they apply to
the file VERLJ_TEST_EFFECTS (one JSON line each, fsynced), as an outside world would see them.

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
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _append(entry: dict) -> None:
    with open(os.environ["VERLJ_TEST_EFFECTS"], "a") as f:
        f.write(json.dumps(entry) + "\n")
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
