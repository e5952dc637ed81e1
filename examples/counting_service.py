"""A service outside the episode, as an MCP server: each ticket it opens is an effect, appended to a file (one JSON line,
fsynced), so that what the world saw can be counted. For rollout.tools (docs/guides/agents.md#tools-through-the-journal):

    python examples/counting_service.py --effects runs/tickets.jsonl --port 8770      # streamable HTTP at http://127.0.0.1:8770/mcp
    verlj train ... rollout.tools=[http://127.0.0.1:8770/mcp]
    verlj train ... 'rollout.tools=["cmd:python examples/counting_service.py --effects runs/tickets.jsonl --stdio"]'

With keys (the default) it honours idempotency keys: `open_ticket` takes `idempotency_key` (verlj passes each call's, and
hides the parameter from the agent), a key seen before is answered with its first result and written as a ``dedup`` line,
never applied again, and its `reconcile` tool tells verlj, after a crash, whether a call sent under a key was applied.
``--no-keys`` serves a service that keeps none and offers no reconcile: every call applied, an unknown outcome unresolved.
"""

from __future__ import annotations

import argparse
import json
import os

from mcp.server.mcpserver import MCPServer


def read_effects(path: str) -> list[dict]:
    """The effects the file at `path` holds, in order; a line torn by a kill mid-write was never applied, and is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line torn by a kill mid-write: never applied
                continue
    return out


def append_effect(path: str, entry: dict) -> None:
    """`entry` appended to the file at `path` as one JSON line, fsynced; after a torn line, on a line of its own."""
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        torn = False  # a line a kill tore mid-write: ended first, left unparsable (never applied)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(entry).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def serve(effects: str, keys: bool) -> MCPServer:
    server = MCPServer("counting")

    def seen() -> list[dict]:
        return read_effects(effects)

    def append(entry: dict) -> None:
        append_effect(effects, entry)

    if keys:
        @server.tool()
        def open_ticket(title: str, idempotency_key: str) -> str:
            """Open a ticket titled `title`."""
            done = next((e["result"] for e in seen() if e["key"] == idempotency_key and e["kind"] == "applied"), None)
            if done is not None:
                append({"key": idempotency_key, "kind": "dedup", "result": done})
                return done
            result = f"ticket opened: {title[:16]}"  # the same for the same call, whenever it comes (the file counts them)
            append({"key": idempotency_key, "kind": "applied", "result": result})
            return result

        @server.tool()
        def reconcile(idempotency_key: str) -> str:
            """What the call sent under this key answered; empty when none arrived."""
            return next((e["result"] for e in seen() if e["key"] == idempotency_key and e["kind"] == "applied"), "")
    else:
        @server.tool()
        def open_ticket(title: str) -> str:  # type: ignore[misc]  # noqa: F811 - the keyless service's
            """Open a ticket titled `title`."""
            result = f"ticket opened: {title[:16]}"
            append({"key": "", "kind": "applied", "result": result, "title": title})
            return result

    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--effects", required=True, help="the file each effect is appended to")
    ap.add_argument("--port", type=int, default=8770)
    ap.add_argument("--no-keys", action="store_true", help="keep no keys and offer no reconcile")
    ap.add_argument("--stdio", action="store_true", help="serve over stdio (rollout.tools=cmd:...) instead of HTTP")
    args = ap.parse_args()
    server = serve(args.effects, not args.no_keys)
    if args.stdio:
        server.run()
    else:
        server.run(transport="streamable-http", host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
