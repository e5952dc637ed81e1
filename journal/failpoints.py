"""Failpoints: named places where a test or the fault campaign can SIGKILL the process on purpose.

    VERLJ_FAILPOINT=journal.before_commit:3 verlj train ...   # die inside the 3rd step commit

A real ``kill -9`` at an exact moment (etcd's failpoints, SQLite's crash tests): nothing is
cleaned up, no handler runs. Unset (the normal case) a failpoint costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("VERLJ_FAILPOINT", "")
_NAME, _, _COUNT = _SPEC.partition(":")
_TARGET = int(_COUNT) if _COUNT else 1
_hits = 0


def failpoint(name: str) -> None:
    global _hits
    if name != _NAME:
        return
    _hits += 1
    if _hits == _TARGET:
        os.kill(os.getpid(), signal.SIGKILL)
