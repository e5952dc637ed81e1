"""The guides' commands run as pasted, on the run they are written against: the README's default run (`verlj train
--output-dir runs/demo`: 200 steps of the built-in job), in a directory of its own where `runs/demo` is that run. Each
line of the blocks named here goes to bash as a reader's shell takes it (the `verlj` the venv installs, a fresh
interpreter each) and must exit 0 with no traceback; what the commands write is then read back. The rest of the docs'
commands are parsed and their configs checked by tests/unit/test_doc_commands.py.

    python -m pytest -n 0 tests/integration/test_guides.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verlj_testing import REPO, env

sys.path.insert(0, str(REPO / "tests" / "unit"))
from test_doc_commands import blocks  # noqa: E402  (the page's fenced blocks, read as that test reads them)

# (page, a line of the block): each block is run whole, line by line, in order
BLOCKS = [
    ("docs/guides/datasets.md", "verlj export runs/demo --sft -o out/sft"),
    ("docs/guides/post-mortem.md", "verlj metrics runs/demo --names critic/score/mean,actor/entropy,actor/grad_norm"),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory, reference_run) -> Path:
    """A reader's working directory: runs/demo is the README's default run (trained once per session)."""
    root = tmp_path_factory.mktemp("reader")
    reference_run(root / "runs" / "demo", [])
    return root


def block(page: str, line: str) -> list[str]:
    text = (REPO / page).read_text()
    found = [body for _, lang, body in blocks(text) if lang == "bash" and line in body]
    assert len(found) == 1, f"{page}: no bash block holds {line!r}"
    return [ln for ln in found[0].replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("page, line", BLOCKS, ids=[p for p, _ in BLOCKS])
def test_a_guides_commands_run_as_pasted(home, page, line):
    bin_dir = str(Path(sys.executable).parent)  # the venv's: `verlj` as the README's set-up installs it
    e = env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for cmd in block(page, line):
        out = subprocess.run(["bash", "-c", cmd], cwd=home, env=e, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "Traceback" not in out.stderr, f"{page}: `{cmd}` exited {out.returncode}\n{out.stderr[-3000:]}"
    if page.endswith("datasets.md"):  # what they wrote: every export, and a clean verify of the first against the run
        for name in ("sft", "rs", "dpo", "pairs", "ids"):
            manifest = json.loads((home / "out" / name / "manifest.json").read_text())
            assert manifest["rows"] > 0, name
        assert json.loads((home / "out" / "ids" / "manifest.json").read_text())["filter"]["first"] == 101
    else:
        assert (home / "demo-metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
