"""The package list, found by setuptools' own discovery (pyproject.toml holds everything else).

journal/, engine/ and cli/ install as verlj.journal, verlj.engine and verlj.cli (``package-dir`` in
pyproject.toml; ``verlj`` itself is a namespace package): every package under those three folders is found
by ``find_packages`` and named under ``verlj.``, so a new sub-package ships without being listed anywhere.
Nothing else (tests/, tools/, examples/) is installed, and no bare top-level ``journal``, ``engine`` or ``cli``.
"""

from setuptools import find_packages, setup

ROOTS = ("journal", "engine", "cli")

setup(packages=[f"verlj.{p}" for p in find_packages(include=[*ROOTS, *(f"{r}.*" for r in ROOTS)])])
