"""What a run's numbers are produced on, recorded at its start (its identity) and at each resume (its
lineage entry) by the one function here, :func:`produced_on`: the versions of the libraries that shape
them, a digest of the verlj source that computes them, of the user modules its config imports by name,
and the hardware torch dispatches to (state.hardware). The ledger stores what this gives; reading it
back (inspect, verify) needs none of it, and loads no deep-learning stack."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import blake3

from ..config import config_from_dict
from ..state.hardware import hardware


def produced_on(config: dict | None = None) -> dict[str, str]:
    """The versions (with the user modules of the stored `config`) and the hardware of this process:
    a run's identity's `versions`, a resume's lineage entry's, what a rerun compares with."""
    return {**versions(config), **hardware()}


def versions(config: dict | None = None) -> dict[str, str]:
    """The versions of what shapes a run's numbers, from the installed packages' metadata (the same
    strings as their __version__; reading them loads no deep-learning stack), a digest of the verlj
    source that computes them (an edit between two runs is a version change too), and with the run's
    stored `config`, a digest of each user module it imports by name (user_modules)."""
    from importlib.metadata import version

    return {
        "verlj": version("verlj"),
        "verlj-source": source_digest(),
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        **(user_modules(config) if config is not None else {}),
    }


def user_modules(config: dict) -> dict[str, str]:
    """'reward module NAME' (rollout.reward_fn=NAME:function) and 'checkpoint policy module NAME'
    (trainer.checkpoint_policy=NAME.Class) -> BLAKE3 of the module's source file, 16 hex digits
    ('missing' when it cannot be found): an edit to the user's code is a version change too."""
    from ..plugins import module_file

    named = {}
    cfg = config_from_dict(config)  # a config that runs here (a resume's, a rerun's): it validates here
    reward = str(cfg.rollout.reward_fn or "")
    if ":" in reward and not reward.startswith("builtin:"):
        named["reward module " + reward.partition(":")[0]] = reward.partition(":")[0]
    policy = cfg.trainer.checkpoint_policy
    if policy and "." in policy:
        named["checkpoint policy module " + policy.rsplit(".", 1)[0]] = policy.rsplit(".", 1)[0]
    out = {}
    for key, module in named.items():
        path = module_file(module)
        out[key] = blake3.blake3(path.read_bytes()).hexdigest()[:16] if path is not None else "missing"
    return out


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """BLAKE3 of the engine's and the journal's Python source (what computes a step), 16 hex digits."""
    import verlj.journal

    h = blake3.blake3()
    for base in (Path(__file__).resolve().parents[1], Path(verlj.journal.__file__).resolve().parent):
        for f in sorted(base.rglob("*.py")):
            h.update(f"{base.name}/{f.relative_to(base)}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]
