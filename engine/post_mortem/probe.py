"""`verlj replay RUN --steps A:B --probe module:function [--workers K]`: new per-step metrics over
past steps (hindsight logging).

The probe is called once a step, as ``fn(step, batch, model) -> {name: number}``, before the step
is applied: ``batch`` is what the step trains on (a list of sample dicts: ``prompt_ids``,
``response_ids``, ``score``, ``rule_reward``, ``gen_logprobs``, ``ref_logprobs``, ``group``,
``index``, ``policy_version``), ``model`` the actor (its ``torch.nn.Module``) holding the
weights the step starts from. The states are the journal's: the steps are replayed from the
newest snapshot before A with every fingerprint and stage checked, so a probe measures the run as
it was. The values go to the run's derived-metrics store (post_mortem.derived), only once every
step was measured; the journal is not written.

``--workers K`` splits A..B at snapshots (each part starts right after one, so no step is
replayed twice) into at most K parts of about equal work, each replayed in its own process from
its own snapshot (the first in this process, the others forked from it once torch and DeepSpeed
are loaded).
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import blake3

from ..errors import PluginError, RunError, loading
from ..loop.ledger import Ledger
from ..plugins import check_signature, describe, import_object
from . import derived
from .rerun import _execute


def load_probe(spec: str):
    module_name, _, attr = spec.partition(":")
    fn = import_object(spec, module_name, attr, "--probe", loading(PluginError))
    if not callable(fn):
        raise PluginError(f"--probe: {spec!r} is not a function")
    check_signature(fn, 3, f"--probe: {spec} (called as fn(step, batch, model))", loading(PluginError))
    return fn


def probe_name(spec: str) -> str:
    """module:function -> module.function (the name its metrics are shown under)."""
    return spec.replace(":", ".")


def probe_version(fn) -> str:
    """Its ``version`` attribute, else its module's ``__version__``, else a digest of its module's source."""
    v = getattr(fn, "version", None) or getattr(sys.modules.get(getattr(fn, "__module__", "")), "__version__", None)
    if v is not None:
        return str(v)
    try:
        src = inspect.getsource(sys.modules[fn.__module__])
    except (OSError, TypeError, KeyError):
        src = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
    return "src-" + blake3.blake3(src.encode()).hexdigest()[:12]


def _measure(run_dir: Path, start: int, stop: int, spec: str) -> list[derived.Row]:
    """fn's metrics for each step start..stop, in this process."""
    fn = load_probe(spec)
    rows: list[derived.Row] = []

    def before(step, inputs, samples, trainer) -> None:
        try:
            out = fn(step, samples, trainer.actor.module)
        except Exception as e:  # noqa: BLE001 - the user's probe: one line naming it
            raise PluginError(f"probe {describe(fn)} raised {type(e).__name__}: {e} (step {step})") from None
        if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                                               and math.isfinite(float(v)) for k, v in out.items()):
            raise PluginError(f"probe {describe(fn)} returned {out!r} at step {step}; it must return {{name: finite number}}")
        rows.append(derived.Row(step, {k: float(v) for k, v in out.items()}))

    with Ledger.open_reader(run_dir) as ledger:
        _execute(run_dir, ledger, start, stop, before=before, checked=True)
    return rows


def _worker(run_dir: str, start: int, stop: int, spec: str) -> list[derived.Row]:
    """One part of the range, in a process of its own (forked before any process group: its own one-rank group)."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return _measure(Path(run_dir), start, stop, spec)


def split(start: int, stop: int, snapshots: list[int], workers: int) -> list[tuple[int, int]]:
    """start..stop in at most `workers` contiguous parts, each after the first beginning right after a
    snapshot, of about equal work (steps replayed from the part's snapshot)."""
    cuts = [s + 1 for s in snapshots if start < s + 1 <= stop]
    if workers <= 1 or not cuts:
        return [(start, stop)]
    base = max([s for s in snapshots if s < start], default=0)
    total = stop - base
    chosen: list[int] = []
    for i in range(1, workers):
        want = base + total * i / workers
        best = min(cuts, key=lambda c: abs(c - 1 - want))
        if best not in chosen and (not chosen or best > chosen[-1]):
            chosen.append(best)
    bounds = [start, *chosen, stop + 1]
    return [(a, b - 1) for a, b in zip(bounds, bounds[1:])]


def probe_steps(run_dir: Path, start: int, stop: int, spec: str, workers: int = 1) -> tuple[list[derived.Row], list[tuple[int, int]], str | None]:
    """Measure start..stop with the probe and store the values (post_mortem.derived). Returns (rows,
    the parts the range was split into, a note when an older version's stored values were dropped)."""
    from .rerun import StepsError, steps_reader

    fn = load_probe(spec)
    if workers < 1:
        raise StepsError(f"--workers must be >= 1, not {workers}")
    run_dir = Path(run_dir)
    with steps_reader(run_dir, start, stop) as ledger:
        snapshots = sorted(ledger.snapshots.index())
    parts = split(start, stop, snapshots, workers)
    if len(parts) == 1:
        rows = _measure(run_dir, start, stop, spec)
    else:
        import multiprocessing
        from concurrent.futures.process import BrokenProcessPool

        from ..rl.trainer import Trainer  # noqa: F401 - loaded once here (torch, DeepSpeed): the forked workers start with it

        # the other parts in forked processes (this one has started no thread and no process group
        # yet), the first one here meanwhile
        with ProcessPoolExecutor(len(parts) - 1, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_worker, str(run_dir), a, b, spec) for a, b in parts[1:]]
            rows = _measure(run_dir, *parts[0], spec)
            try:
                rows += [row for f in futures for row in f.result()]
            except BrokenProcessPool:
                raise RunError(f"a --workers process died while measuring steps {start}–{stop}; nothing was stored") from None
    note = derived.store(run_dir, probe_name(spec), probe_version(fn), rows)
    return rows, parts, note
