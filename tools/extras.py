"""The extras that do not install beside `dev`, each tried in a virtual environment of its own: installed as a user
installs it (`pip install -e '.[EXTRA,...]'` after torch 2.13.0, with the extras harness.APART_INSTALL names beside it,
and pytest), and its tests run there.

    python tools/extras.py                 # every extra in harness.APART (.ci/run calls this)
    python tools/extras.py --only verifiers
    python tools/extras.py --keep          # leave .extras/EXTRA in place (the next call reuses it)

Why: verifiers 0.4 pins openai<3 and mcp==2.0.0, and the `dev` and `agent` extras' openai-agents (0.24) needs openai>=3:
pip refuses the pair. LangChain's MCP adapters (0.3) pin mcp<2, and verlj's tools server is mcp 2's: a LangChain agent runs
in an interpreter of its own (a `cmd:` agent), whose venv holds LangChain alone (harness.AGENT_SIDE), and its tests run in
this interpreter (the suite's) with VERLJ_TESTS_AGENT_PYTHON naming that venv's python. The suite's own venv has `dev`, so the tests of such an extra (harness.APART names them) are not
collected there; this runs them where the extra installs. One line per extra; exit 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".extras"
sys.path.insert(0, str(REPO / "tests"))
from harness import AGENT_SIDE, APART, APART_INSTALL  # noqa: E402 - the one list of which tests need which extra

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}


def step(cmd: list[str], log, timeout: float = 1800) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **ENV})
    log.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(cmd[2:5])} exited {out.returncode}: {last[0]}")


def environment(extra: str, log) -> Path:
    """.extras/EXTRA's python: a venv of this interpreter with torch 2.13.0, verlj[EXTRA,...] editable, pytest and xdist;
    for an agent's own interpreter (harness.AGENT_SIDE), its packages alone."""
    venv = CACHE / extra
    py = venv / "bin" / "python"
    if (venv / ".ready").is_file() and py.is_file():
        return py
    shutil.rmtree(venv, ignore_errors=True)
    step([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(py), "-m", "pip"]
    if extra in AGENT_SIDE:
        step([*pip, "install", "-q", *AGENT_SIDE[extra]], log)
    else:
        step([*pip, "install", "-q", "torch==2.13.0"], log)
        step([*pip, "install", "-q", "-e", f".[{APART_INSTALL.get(extra, extra)}]", "pytest>=8", "pytest-xdist>=3.5"], log)
    step([*pip, "check"], log)  # the extras' pins hold together
    if extra not in AGENT_SIDE:
        step([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec", "triton"], log)  # as .ci/run does
    (venv / ".ready").write_text(time.strftime("%Y-%m-%d %H:%M:%S"))
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(APART), help="these extras only")
    ap.add_argument("--keep", action="store_true", help="keep .extras/EXTRA for the next call")
    args = ap.parse_args()
    failed = 0
    for extra in args.only or sorted(APART):
        t0 = time.monotonic()
        CACHE.mkdir(exist_ok=True)
        with open(CACHE / f"{extra}.log", "w") as log:
            try:
                py = environment(extra, log)
                tests = [f"tests/{t}" for t in APART[extra]]
                beside = {"VERLJ_TESTS_AGENT_PYTHON": str(py)} if extra in AGENT_SIDE else {}  # run here, the agent there
                out = subprocess.run([sys.executable if beside else str(py), "-m", "pytest", *tests], capture_output=True, text=True,
                                     cwd=REPO, env={**os.environ, **ENV, **beside}, timeout=1800)
                log.write(out.stdout + out.stderr)
                ok = out.returncode == 0
                said = next((ln.strip("= ") for ln in reversed(out.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", ln)),
                            f"pytest exited {out.returncode}")
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                ok, said = False, str(e)
        print(f"{'✓' if ok else '✗'} verlj[{extra}]: {' '.join(APART[extra])}: {said} ({time.monotonic() - t0:.0f} s)"
              + ("" if ok else f"; the log: {CACHE / extra}.log"), flush=True)
        if ok and not args.keep:
            shutil.rmtree(CACHE / extra, ignore_errors=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
