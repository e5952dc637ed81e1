"""Every resumable part of a run, in one shape, versioned in one style (torchtitan's Stateful).

    class Sampler:
        VERSION = 1
        def state_dict(self) -> dict:
            return {"version": self.VERSION, "epoch": self.epoch, "cursor": self.cursor}
        def load_state_dict(self, state: dict) -> None:
            state = check_version("sampler", state, self.VERSION)
            ...

A part's state is msgpack-encodable data (never pickled). The checkpointer (loop.checkpointer) keeps
each part where its kind says (the rank-agnostic anchor, each rank's own file, or, for the DeepSpeed
engines, DeepSpeed's own sharded files) and loads them all in one loop.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import SnapshotError

VERSION_KEY = "version"  # every part's state map holds its version under this key (the rest is the part's own)


class Stateful(Protocol):
    VERSION: int

    def state_dict(self) -> dict:
        """Everything the part needs to continue exactly, with "version": VERSION."""

    def load_state_dict(self, state: dict) -> None:
        """Become what state_dict returned (check_version first)."""


def check_version(name: str, state: dict, version: int, oldest: int | None = None) -> dict:
    """`state` when this code wrote it, or an older version from `oldest` on that the part still reads
    (a state without a version, from before parts carried one, is version 1); otherwise one sentence
    naming the part."""
    got = state.get(VERSION_KEY, 1) if isinstance(state, dict) else None
    if not isinstance(got, int) or not (oldest or version) <= got <= version:
        raise SnapshotError(f"the snapshot's {name} state has version {got!r}; this verlj reads version {version} "
                            "(the snapshot was written by another verlj)")
    return state
