"""Failpoints: named places where a test or the fault campaign can act on a process on purpose.

    VERLJ_FAILPOINT=journal.before_commit:3 verlj train ...          # SIGKILL inside the 3rd step commit
    VERLJ_FAILPOINT=step.before_commit:1:sleep=5 verlj train ...     # stall 5 s there instead

A real ``kill -9`` at an exact moment (etcd's failpoints, SQLite's crash tests): nothing is
cleaned up, no handler runs. Unset (the normal case) a failpoint costs one string compare.
"""

from __future__ import annotations

import os
import signal
import time

_SPEC = os.environ.get("VERLJ_FAILPOINT", "")
_NAME, _, _REST = _SPEC.partition(":")
_COUNT, _, _ACTION = _REST.partition(":")
_TARGET = int(_COUNT) if _COUNT else 1
_hits = 0


def failpoint(name: str) -> None:
    global _hits
    if name != _NAME:
        return
    _hits += 1
    if _hits != _TARGET:
        return
    if _ACTION.startswith("sleep="):
        time.sleep(float(_ACTION.split("=", 1)[1]))
    else:
        os.kill(os.getpid(), signal.SIGKILL)
