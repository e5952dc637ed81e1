"""Loading user code named in a config (`module:function` reward functions, dotted checkpoint
policies), with one clear sentence for every way it can fail.

The working directory is importable, as with ``python -m``: a ``my_rewards.py`` beside the config
works from the ``verlj`` script too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any


def _cwd_importable() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_object(spec: str, module_name: str, attr: str, key: str, error: type[Exception]) -> Any:
    """`module_name`.`attr` (as the config wrote it: `spec`), or `error` naming `key` and what went wrong."""
    _cwd_importable()
    if not module_name or not attr:
        raise error(f"{key}: {spec!r} must name a module and an attribute in it")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{key}: cannot import {spec!r} ({e})") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed while importing
        raise error(f"{key}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise error(f"{key}: cannot import {spec!r} (module {module_name!r} has no {attr!r})")
    return getattr(module, attr)


def module_file(module_name: str) -> Path | None:
    """The source file of the user module `module_name` (the one imported, else the one an import would
    load; its package's ``__init__.py`` for a package), or None when there is none."""
    _cwd_importable()
    module = sys.modules.get(module_name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    return Path(origin) if origin and Path(origin).is_file() else None


def check_signature(fn: Callable, n_args: int, what: str, error: type[Exception], **kwargs) -> None:
    """fn must accept n_args positional arguments (and kwargs); else `error` naming `what`."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    try:
        sig.bind(*range(n_args), **kwargs)
    except TypeError as e:
        raise error(f"{what} has the wrong signature {sig} ({e})") from None


def describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@lru_cache(maxsize=1)
def _roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(verlj's own folders, the libraries' folders: the standard library and site-packages), each ending in a separator."""
    own = [Path(__file__).resolve().parent]  # engine/
    for name in ("verlj.journal", "verlj.cli"):
        spec = importlib.util.find_spec(name)
        own += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec is not None else []
    paths = sysconfig.get_paths()
    libs = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(str(p) + os.sep for p in own), tuple(str(p) + os.sep for p in libs)


def raised_at(e: BaseException) -> str:
    """Where the user's code raised `e`, for a fault's reason: `` (at my_env.py:42)``, the innermost frame of
    its traceback outside verlj's own package and outside the libraries (the standard library, site-packages);
    else the innermost outside verlj's package (a library the user's function called); "" when all are verlj's."""
    own, libs = _roots()
    outside = [f for f in traceback.extract_tb(e.__traceback__) if not os.path.realpath(f.filename).startswith(own)]
    user = [f for f in outside if not os.path.realpath(f.filename).startswith(libs)]
    frames = user or outside
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
