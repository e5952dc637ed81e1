"""bf16 as users train on GPUs (trainer.precision=bf16: DeepSpeed's bf16 configuration, bf16 compute with fp32
master weights in the optimizer) on CPU: SIGKILLed right after a commit and resumed, the run is bit-identical to
an uninterrupted one, at ZeRO 0 (DeepSpeed's BF16_Optimizer) and ZeRO 3 (masters partitioned)."""

from __future__ import annotations

import pytest
import torch

from verlj.engine.loop.run import train as run_train
from verlj.engine.state.safe_load import load_weights_only
from verlj_testing import TINY, fingerprints, kill_and_resume

pytestmark = pytest.mark.slow

BF16 = ["trainer.precision=bf16", "trainer.total_steps=5", "trainer.save_interval=2"]


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_killed_and_resumed_is_bit_identical(tmp_path, stage):
    over = [*BF16, f"distributed.zero_stage={stage}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_train(ref, None, [*TINY, *over])
    out = kill_and_resume(run, ref, *over, failpoint="journal.after_commit:3")
    assert "Replayed step 3 from the journal" in out.stdout + out.stderr and len(fingerprints(ref)) == 5
    if stage == 0:  # the snapshot keeps the fp32 masters beside the bf16 weights
        states = load_weights_only(run / "step_00004" / "actor" / "mp_rank_00_model_states.pt")
        assert {t.dtype for t in states["module"].values()} == {torch.bfloat16}
        masters = states["optimizer"]["fp32_groups"]
        assert masters and all(t.dtype == torch.float32 for group in masters for t in group)
