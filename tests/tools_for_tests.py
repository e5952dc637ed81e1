"""Tools for the tests of rollout.tools (rl.gateway.tools): services outside the episode that append every effect they apply to
the file VERLJ_TEST_EFFECTS (one JSON line each, fsynced), as an outside world would see them. They run in the trainer's
process, so a SIGKILL can tear the line being written: a torn line is an effect never applied (skipped when read; the next
line begins on a line of its own).

open_ticket honours idempotency keys (a key applied before is answered with its first result, the re-send written as
``dedup``) and offers a reconcile (the result stored under a key, None when none is); post_message honours nothing and offers
no reconcile."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from verlj.engine.rl.gateway.tools import tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from counting_service import append_effect, read_effects  # noqa: E402 - the example service's file of effects, read and written as it does


def _effects() -> list[dict]:
    return read_effects(os.environ["VERLJ_TEST_EFFECTS"])  # (the trainer's process runs these services: a kill can tear a line)


def _append(entry: dict) -> None:
    append_effect(os.environ["VERLJ_TEST_EFFECTS"], entry)


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
