"""Per-step seeds: ``seed = H(run_seed, step, stream, *extra)``, so no stream depends on another's history."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import torch

from ..schema.record import Record, stored
from .stateful import check_version


def derive_seed(run_seed: int, step: int, stream: str, *extra: int) -> int:
    text = f"{run_seed}/{step}/{stream}/" + "/".join(map(str, extra))
    return int.from_bytes(blake3.blake3(text.encode()).digest()[:8], "big") >> 1  # 63 bits: fits int64


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def seed_globals(seed: int) -> None:
    """Seed torch, numpy and python's global generators: whatever draws from them (a library, by
    accident) draws the same numbers live, after a resume and in replay."""
    import random

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_digest() -> dict[str, str]:
    """Digests of the global generators: a step that drew from one by accident shows up in the journal."""
    import random

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "torch": blake3.blake3(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
        "numpy": blake3.blake3(np.random.get_state(legacy=True)[1].tobytes()).hexdigest()[:16],  # type: ignore[index]  # legacy: a tuple
        "python": blake3.blake3(repr(random.getstate()).encode()).hexdigest()[:16],
        **({"cuda": blake3.blake3(torch.cuda.get_rng_state().numpy().tobytes()).hexdigest()[:16]} if cuda else {}),
    }


@dataclass(frozen=True)
class GeneratorStates(Record):
    """RNGState's state map (rng_rankNNNNN.msgpack): each global generator's state as plain data (cuda:
    one per device, only where CUDA was in use)."""

    version: int
    torch: np.ndarray = field(metadata=stored(dtype=np.uint8))  # torch.get_rng_state()
    numpy: list[Any]  # np.random.get_state(): [kind, keys (uint32), pos, has_gauss, cached]
    python: list[Any]  # random.getstate(): [version, internal state, gauss]
    cuda: list[np.ndarray] | None = field(default=None, metadata=stored(dtype=np.uint8, optional=True))  # one per device


class RNGState:
    """The process's global generators (torch, numpy, python, cuda) as a Stateful part of a snapshot,
    one per rank. Every step reseeds them, so this matters only for code that draws outside a step."""

    VERSION = 1

    def state_dict(self) -> dict:
        import random

        cuda = [s.numpy() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return GeneratorStates(self.VERSION, torch.get_rng_state().numpy(), list(np.random.get_state()),
                               _py_rng_to_plain(random.getstate()), cuda).to_dict()

    def load_state_dict(self, state: dict) -> None:
        import random

        states = GeneratorStates.from_dict(check_version("random generators", state, self.VERSION))
        torch.set_rng_state(torch.from_numpy(np.asarray(states.torch, dtype=np.uint8)))
        kind, keys, pos, has_gauss, cached = states.numpy
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
        version, internal, gauss = states.python
        random.setstate((version, tuple(internal), gauss))
        if states.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.from_numpy(np.asarray(s, dtype=np.uint8)) for s in states.cuda])


def _py_rng_to_plain(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]
