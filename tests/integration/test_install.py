"""A non-editable install works: the wheel setuptools builds from this tree, installed into a fresh virtual
environment, trains and verifies a run from another directory.

The wheel is built without build isolation (the test venv's setuptools; no index needed) from a copy of the
tree, and installed with --no-deps; the new environment reads its dependencies (torch, DeepSpeed, ...) from the
test venv's site-packages through a plain path line in a .pth file, which does not run the editable install's
finder: `verlj` there is the wheel's alone, as the import check below asserts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from verlj_testing import REPO, TINY, env

SOURCES = ("journal", "engine", "cli", "pyproject.toml", "setup.py", "README.md")


def _built_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(p, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("verlj-*.whl")
    return wheel


def _venv_with(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_wheel_installs_and_trains_from_another_directory(tmp_path):
    wheel = _built_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"verlj", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    for package in ("journal", "engine", "cli", "engine/schema", "engine/rl", "engine/loop", "engine/state", "engine/post_mortem"):
        assert f"verlj/{package}/__init__.py" in names, package  # every package found, none listed by hand
    for page in ("index.html", "app.js", "style.css"):  # `verlj view`'s page, package data
        assert f"verlj/engine/post_mortem/view/static/{page}" in names, page

    venv = _venv_with(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    e = env()
    e.pop("PYTHONPATH", None)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import verlj.engine.schema, verlj.cli.main; print(verlj.engine.schema.__file__)"],
                           capture_output=True, text=True, env=e, cwd=elsewhere, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's, not this checkout's

    verlj = str(venv / "bin" / "verlj")
    trained = subprocess.run([verlj, "train", "--output-dir", "run", *TINY, "trainer.total_steps=3"],
                             capture_output=True, text=True, env=e, cwd=elsewhere, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "Traceback" not in trained.stderr
    assert "Step 3" in trained.stdout + trained.stderr
    verified = subprocess.run([verlj, "verify", "run"], capture_output=True, text=True, env=e, cwd=elsewhere, timeout=600)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
