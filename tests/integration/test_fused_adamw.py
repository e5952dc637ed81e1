"""model.actor.optim.fused: a new run steps AdamW with torch's fused kernel (Hugging Face's Trainer's default,
one pass over each parameter's state), a run stored before the key keeps torch's default per-tensor AdamW.
The two round differently, so the choice is fixed for a run: an old run resumes and replays with the
optimizer it trained with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from verlj.engine.config import Config, ConfigError, check_change, config_from_dict, stored_config
from verlj_testing import LEAVE, env

_STEPS = r"""
import json, sys, torch
from verlj.engine.config import Config, config_from_dict, stored_config
from verlj.engine.dist import setup
from verlj.engine.rl import workers
from verlj.engine.rl.models import BUILTIN_TINY, load_causal_lm

old = Config().to_dict()
del old["model"]["actor"]["optim"]["fused"]  # a run stored before the key
torch.use_deterministic_algorithms(True)
rt = None
out = {}
for name, stored in (("new", Config().to_dict()), ("old", old)):
    cfg = config_from_dict(stored_config(stored))
    cfg.trainer.precision = sys.argv[1]
    rt = rt or setup(cfg)
    e = workers.make_engine(load_causal_lm(BUILTIN_TINY, cfg, 0), cfg.model.actor.optim, cfg, rt, 2)
    inner = e.optimizer if isinstance(e.optimizer, torch.optim.Optimizer) else e.optimizer.optimizer
    for step in range(3):
        ids = torch.randint(0, e.module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(step))
        e.backward(e(input_ids=ids, labels=ids).loss)
        if not e.enable_backward_allreduce:
            workers.reduce_alone(e)
        e.step()
    # the weights the optimizer steps (bf16: its fp32 master copy; the module's bf16 rounding can hide a difference)
    out[name] = bool(inner.defaults.get("fused")), [p.detach().clone() for g in inner.param_groups for p in g["params"]]
same = all(torch.equal(a, b) for a, b in zip(out["new"][1], out["old"][1]))
print(json.dumps({"new_fused": out["new"][0], "old_fused": out["old"][0], "same_bits": same}))
"""


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_new_runs_step_fused_adamw_and_old_runs_keep_theirs(tmp_path, precision):
    import json

    out = subprocess.run([sys.executable, "-c", _STEPS + LEAVE, precision], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the new run's optimizer is the fused kernel, the old run's is not, and three steps from the same
    # weights end in different bits: the old run's trajectory needs its own optimizer
    assert got == {"new_fused": True, "old_fused": False, "same_bits": False}, got


def test_the_optimizer_kernel_cannot_change_within_a_run():
    old = Config().to_dict()
    del old["model"]["actor"]["optim"]["fused"]
    assert config_from_dict(stored_config(old)).model.actor.optim.fused is False
    assert config_from_dict(stored_config(Config().to_dict())).model.actor.optim.fused is True
    assert check_change(stored_config(old), config_from_dict(stored_config(old)), allow_live=False, how="resume") == []
    with pytest.raises(ConfigError, match="model.actor.optim.fused cannot change within a run"):
        check_change(stored_config(old), config_from_dict(stored_config(Config().to_dict())), allow_live=False, how="resume")
