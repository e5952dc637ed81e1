"""The step's console line (report.Reporter.step): reward, loss and time, or that no update was made."""

from verlj.engine.config import LoggingConfig
from verlj.engine.report import PG_LOSS, REWARD_MEAN, SKIPPED_UPDATE, STEP_TIME, Reporter


def lines(tmp_path, capsys, metrics, note=""):
    rep = Reporter(LoggingConfig(progress="lines", jsonl=False), tmp_path, True, 10)
    rep.step(3, metrics, note)
    rep.close()
    return capsys.readouterr().out.strip()


def test_a_trained_step_says_its_reward_and_loss(tmp_path, capsys):
    out = lines(tmp_path, capsys, {REWARD_MEAN: 0.25, PG_LOSS: -0.5, STEP_TIME: 1.0}, "faults 1/4: step raised X")
    assert out == "[INFO] Step 3: reward=0.25 loss=-0.5 time=1.00s faults 1/4: step raised X"


def test_a_step_without_an_update_says_so_not_nan(tmp_path, capsys):
    out = lines(tmp_path, capsys, {REWARD_MEAN: float("nan"), SKIPPED_UPDATE: 1.0, STEP_TIME: 1.0}, "faults 4/4: step raised X")
    assert out == "[INFO] Step 3: no update (no sample to train on) time=1.00s faults 4/4: step raised X"
