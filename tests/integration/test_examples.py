"""Every config in examples/ runs, at a few steps, as its header says it is run (so none rots); the
examples whose header goes on with more commands (a resume on another topology, an export read
by pandas, verify) run those too."""

from pathlib import Path

import pytest
import yaml

from verlj_testing import REPO, cli, verlj

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SHORT = ["trainer.total_steps=3", "trainer.save_interval=2", "data.prompts_per_step=4", "logging.progress=lines"]  # each at its own scale but these


def header_commands(path: Path) -> list[str]:
    """The commands the example's header shows (lines '#   verlj ...', '#   torchrun ...', '#   python ...')."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        cmd = line.lstrip("#").strip()
        if cmd.split(" ", 1)[0] in ("verlj", "torchrun", "python"):
            out.append(cmd)
    return out


def test_every_example_is_a_valid_config_with_a_header_that_runs_it():
    from verlj.engine.config import make_config

    assert len(EXAMPLES) >= 7
    for path in EXAMPLES:
        assert isinstance(yaml.safe_load(path.read_text()), dict)
        make_config(path)
        commands = header_commands(path)
        assert any(f"--config examples/{path.name}" in c for c in commands), path.name  # a set-up line may come first


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path, request):
    run = tmp_path / "run"
    local = [f"journal.local_dir={tmp_path / 'local'}"] if "local_dir" in path.read_text() else []
    if any("examples/make_bpe_model.py" in c for c in header_commands(path)):  # the header makes the BPE model first: the fixture's
        local.append(f"model.actor.model_name_or_path={request.getfixturevalue('bpe_model')}")
    ranks = 2 if any(c.startswith("torchrun") for c in header_commands(path)) else 1
    verlj("train", "--config", path, "-o", run, *SHORT, *local, ranks=ranks, check=True, timeout=600)
    assert (run / "step_00003" / "manifest.json").is_file()
    if ranks == 2:  # the header's resume on one rank: resharded, replayed within tolerance, trained on
        out = verlj("train", "--config", path, "-o", run, *SHORT, "trainer.total_steps=5", "--resume", check=True)
        assert "topology" in out.stdout and "->" in out.stdout, out.stdout[-2000:]
        assert (run / "step_00005" / "manifest.json").is_file()
    if path.stem == "retention_archive":
        cli("export", run, "--rollouts", "-o", tmp_path / "r.parquet", check=True)
        import pandas as pd

        table = pd.read_parquet(tmp_path / "r.parquet")
        assert sorted(table.step.unique()) == [1, 2, 3] and table.score.notna().all()
    for cmd in header_commands(path):
        if cmd.startswith("verlj verify"):
            cli("verify", run, check=True)
