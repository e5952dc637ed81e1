"""`verlj replay RUN --steps A:B --probe module:function`: new per-step metrics over past steps.

The probe is called once a step, as ``fn(step, batch, model) -> {name: number}``, before the step
is applied: ``batch`` is what the step trains on (a list of sample dicts: ``prompt_ids``,
``response_ids``, ``score``, ``rule_reward``, ``gen_logprobs``, ``ref_logprobs``, ``group``,
``index``, ``policy_version``), ``model`` the actor (its ``torch.nn.Module``) holding the
weights the step starts from. The states are the journal's: the steps are replayed from the
newest snapshot before A with every fingerprint and stage checked, so a probe measures the run as
it was. Nothing is written into the run. (``--workers``, ranges split over processes, is not
built.)
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path

from ..errors import PluginError, RunError
from ..loop.ledger import Ledger, has_run
from ..plugins import check_signature, describe, import_object
from .rerun import _execute


def load_probe(spec: str):
    module_name, _, attr = spec.partition(":")
    fn = import_object(spec, module_name, attr, "--probe", PluginError)
    if not callable(fn):
        raise PluginError(f"--probe: {spec!r} is not a function")
    check_signature(fn, 3, f"--probe: {spec} (called as fn(step, batch, model))", PluginError)
    return fn


def probe_steps(run_dir: Path, start: int, stop: int, spec: str) -> list[dict]:
    """[{"step": s, **fn's metrics}] for s in start..stop."""
    from .rerun import StepsError

    fn = load_probe(spec)
    run_dir = Path(run_dir)
    if not has_run(run_dir):
        raise RunError(f"{run_dir} is not a verlj run (no journal/)")
    rows: list[dict] = []

    def before(step, inputs, samples, trainer) -> None:
        try:
            out = fn(step, samples, trainer.actor.module)
        except Exception as e:  # noqa: BLE001 - the user's probe: one line naming it
            raise PluginError(f"probe {describe(fn)} raised {type(e).__name__}: {e} (step {step})") from None
        if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                                               and math.isfinite(float(v)) for k, v in out.items()):
            raise PluginError(f"probe {describe(fn)} returned {out!r} at step {step}; it must return {{name: finite number}}")
        rows.append({"step": step, **{k: float(v) for k, v in out.items()}})

    with Ledger.open_reader(run_dir) as ledger:
        last, base = ledger.last_step(), ledger.base_step()
        if not base < start <= stop <= last:
            raise StepsError(f"--steps {start}:{stop} is out of range: {run_dir} has steps {base + 1}–{last}")
        _execute(run_dir, ledger, start, stop, before=before, checked=True)
    return rows
