"""Failpoints: named places where a test or the fault campaign can act on a process on purpose.

    VERLJ_FAILPOINT=journal.before_commit:3 verlj train ...          # SIGKILL inside the 3rd step commit
    VERLJ_FAILPOINT=step.before_commit:1:sleep=5 verlj train ...     # stall 5 s there instead
    VERLJ_FAILPOINT=ship.before_publish:2:sleep=3,snapshot.rotate:1  # several, comma-separated

A real ``kill -9`` at an exact moment (etcd's failpoints, SQLite's crash tests): nothing is
cleaned up, no handler runs. ``sleep=S`` stalls the S seconds at that hit; ``sleep-each=S``
stalls at that hit and every later one. Any other action is handed back to the call site, which
acts on it: ``update.grads:3:flip=7`` flips one bit (chosen by seed 7) in the gradients of the 3rd
optimizer step, ``update.params:2:flip=7`` in the actor's parameters after the 2nd step's update
(silent data corruption, for `verlj rerun` to find). Unset (the normal case) a failpoint costs one
dict lookup. VERLJ_FAILPOINT is read at the first failpoint a process reaches, not when this module is
imported: a process forked from one that imported verlj (the test suite's fork server) arms what its own
environment says.
"""

from __future__ import annotations

import os
import signal
import time


def _parse(spec: str) -> dict[str, tuple[int, str]]:
    out = {}
    for part in filter(None, spec.split(",")):
        name, _, rest = part.partition(":")
        count, _, action = rest.partition(":")
        out[name] = (int(count) if count else 1, action)
    return out


_POINTS: dict[str, tuple[int, str]] | None = None  # what VERLJ_FAILPOINT arms, read at the first failpoint
_hits: dict[str, int] = {}


def failpoint(name: str) -> str | None:
    """Act at this hit of `name` when it is armed; returns an action that is the call site's to carry out."""
    global _POINTS
    if _POINTS is None:
        _POINTS = _parse(os.environ.get("VERLJ_FAILPOINT", ""))
    armed = _POINTS.get(name)
    if armed is None:
        return None
    target, action = armed
    _hits[name] = hit = _hits.get(name, 0) + 1
    if action.startswith("sleep-each="):
        if hit >= target:
            time.sleep(float(action.split("=", 1)[1]))
    elif hit != target:
        return None
    elif action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))
    elif action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        return action
    return None
