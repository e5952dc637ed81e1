"""The interpreters verlj claims, tried: ZeRO 1-3 snapshots saved, verified, resumed and replayed under
every Python 3.10-3.13 on this machine, and each interpreter's snapshots read by another.

    python tools/interpreters.py                    # every Python 3.10-3.13 found (.ci/run calls this)
    python tools/interpreters.py --list             # which interpreters it would use, and stop
    python tools/interpreters.py --only 3.11.2 3.12.1

Why: DeepSpeed's ZeRO optimizer states hold an int-mixin enum member, which Python 3.11.0-3.11.4
pickle by name (getattr) and the others by value; verlj's snapshots must load whichever interpreter
wrote them and whichever reads them (engine/state/safe_load.py).

Each interpreter other than the one running this gets a virtual environment in .interpreters/VERSION
(kept between runs) with torch 2.13.0 (the CPU build on this machine's disk for 3.11; elsewhere
PyPI's build, which runs on the CPU: about 3.5 GB, 1-2 minutes to install) and verlj installed
editable. Then:
  1. tests/unit/test_safe_load.py and tests/integration/test_interpreters.py run under it (ZeRO 1, 2
     and 3: saved, verified, resumed exactly against an uninterrupted run, replayed);
  2. a ZeRO-2 run of 2 steps is written under each interpreter, including this one, and verified and
     resumed two steps further under the next one in the ring (3.10 -> 3.11.2 -> 3.11.7 -> 3.12 ->
     3.13 -> 3.10): the snapshot loads, and the loaded state's fingerprint is the one saved (the
     resume checks it).
One line per result; exit 1 if anything failed.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".interpreters"
TESTS = ["tests/unit/test_safe_load.py", "tests/integration/test_interpreters.py"]
TINY = ["data.prompts_per_step=4", "rollout.n=4", "rollout.max_response_length=4", "model.actor.micro_batch_size=4",
        "logging.progress=lines", "trainer.save_interval=2", "distributed.zero_stage=2"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}


def candidates() -> list[str]:
    found = [sys.executable, *glob.glob("/usr/bin/python3.1[0-3]"), *glob.glob("/usr/local/bin/python3.1[0-3]"), "/usr/bin/python3"]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found += sorted(glob.glob(str(pyenv / "3.1[0-3].*" / "bin" / "python3")))
    found += [p for p in (shutil.which(f"python3.{m}") for m in range(10, 14)) if p]
    return found


def version_of(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "-c", "import sys; print('.'.join(map(str, sys.version_info[:3])))"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None  # a pyenv shim for a version not selected fails


def interpreters() -> dict[str, str]:
    """{version: executable}, one per version 3.10-3.13, this interpreter first for its own version."""
    out: dict[str, str] = {}
    for exe in candidates():
        v = version_of(exe)
        if v and (3, 10) <= tuple(map(int, v.split(".")[:2])) <= (3, 13) and v not in out:
            out[v] = exe
    return dict(sorted(out.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))


def run(cmd: list[str], log, timeout: float, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **ENV}, **kw)
    log.write(f"$ {' '.join(map(str, cmd))}  -> {out.returncode}\n{out.stdout[-20000:]}\n{out.stderr[-20000:]}\n")  # one write: threads
    log.flush()
    return out


def environment(version: str, exe: str, log) -> str:
    """The venv's python for `version` (made once, kept in .interpreters/)."""
    if exe == sys.executable:
        return exe
    venv = CACHE / version
    py = venv / "bin" / "python"
    if (venv / ".ready").is_file() and py.is_file():
        return str(py)
    shutil.rmtree(venv, ignore_errors=True)
    steps = [[exe, "-m", "venv", str(venv)],
             [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
             [str(py), "-m", "pip", "install", "-q", "-e", ".", "pytest>=8", "pytest-xdist>=3.5"]]
    for cmd in steps:
        out = run(cmd, log, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[1:4])} …` failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}")
    (venv / ".ready").write_text(time.strftime("%Y-%m-%d %H:%M:%S"))
    return str(py)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the interpreters found and stop")
    ap.add_argument("--only", nargs="+", metavar="VERSION", help="these versions only (as --list prints them)")
    args = ap.parse_args()
    found = interpreters()
    if args.only:
        missing = sorted(set(args.only) - set(found))
        if missing:
            print(f"error: no Python {', '.join(missing)} on this machine (found: {', '.join(found)})", file=sys.stderr)
            return 2
        found = {v: e for v, e in found.items() if v in args.only}
    for v, exe in found.items():
        print(f"Python {v}: {exe}" + ("  (this one)" if exe == sys.executable else ""))
    if args.list:
        return 0
    CACHE.mkdir(exist_ok=True)
    failed: list[str] = []
    log_path = CACHE / "last-run.log"
    work = Path(tempfile.mkdtemp(prefix="verlj-interpreters-"))
    t_all = time.time()
    with open(log_path, "w") as log:
        pythons: dict[str, str] = {}

        def make(v: str) -> None:  # the installs wait on downloads and disk: all at once
            t0 = time.time()
            try:
                pythons[v] = environment(v, found[v], log)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                failed.append(f"Python {v}: environment: {e}")
                print(f"✗ Python {v}: environment: {e}", flush=True)
                return
            if pythons[v] != sys.executable:
                print(f"  Python {v}: environment ready in {time.time() - t0:.0f} s", flush=True)

        with ThreadPoolExecutor(max_workers=len(found)) as pool:
            list(pool.map(make, found))
        pythons = {v: pythons[v] for v in found if v in pythons}  # in version order
        for v, py in pythons.items():
            if py == sys.executable:
                continue  # this interpreter runs them in the suite itself
            t0 = time.time()
            out = run([py, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "load", *TESTS], log,
                      timeout=1800)
            tail = next((line.strip("= ") for line in reversed(out.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                        f"exit {out.returncode}")
            ok = out.returncode == 0
            print(f"{'✓' if ok else '✗'} Python {v}: {' '.join(t.rsplit('/', 1)[1] for t in TESTS)}: {tail} ({time.time() - t0:.0f} s)",
                  flush=True)
            if not ok:
                failed.append(f"Python {v}: tests: {tail}")
        ring = list(pythons)
        written = {}
        for v in ring:  # each writes a ZeRO-2 run of 2 steps
            run_dir = work / f"written-by-{v}"
            out = run([pythons[v], "-m", "verlj.cli", "train", "-o", str(run_dir), "trainer.total_steps=2", *TINY], log, timeout=600)
            if out.returncode != 0:
                failed.append(f"Python {v}: writing a ZeRO-2 run: exit {out.returncode}")
                print(f"✗ Python {v}: writing a ZeRO-2 run failed (exit {out.returncode}; see {log_path})", flush=True)
                continue
            written[v] = run_dir
        for i, v in enumerate(ring):
            reader = ring[(i + 1) % len(ring)]
            if v not in written or reader == v:
                continue
            run_dir = written[v]
            ver = run([pythons[reader], "-m", "verlj.cli", "verify", str(run_dir)], log, timeout=600)
            res = run([pythons[reader], "-m", "verlj.cli", "train", "-o", str(run_dir), "--resume", "trainer.total_steps=4", *TINY], log,
                      timeout=600)
            problems = []
            if ver.returncode != 0 or "✗" in ver.stdout or "⚠" in ver.stdout:
                problems.append(f"verify exit {ver.returncode}")
            if res.returncode != 0 or f"Resuming from checkpoint: {run_dir / 'step_00002'}" not in res.stdout:
                problems.append(f"resume exit {res.returncode}: {(res.stderr.strip().splitlines() or [''])[-1][:200]}")
            line = f"snapshot written by Python {v}, verified and resumed by Python {reader}"
            print(f"{'✗' if problems else '✓'} {line}" + (f": {'; '.join(problems)}" if problems else ""), flush=True)
            if problems:
                failed.append(line)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{len(found)} interpreters, {time.time() - t_all:.0f} s; the commands and their output: {log_path}")
    if failed:
        print(f"FAILED: {len(failed)}: " + "; ".join(failed))
        return 1
    print("OK: every interpreter saves, verifies, resumes and reads the others' snapshots.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
