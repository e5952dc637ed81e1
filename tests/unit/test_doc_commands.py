"""Every command the docs show parses as verlj parses it: each shell line of the README, the docs pages and the examples'
headers that runs `verlj` (or `torchrun ... -m verlj.cli`, or `ray job submit ... -- verlj`) has the options and
arguments its command takes, its config file and overrides make a valid config (the keys exist, the values are
allowed), and a `python` script it runs exists. A line the docs show failing (`$ verlj ...` followed by `error: ...`)
fails so. What each command does when run is the integration tests' (tests/integration/test_guides.py runs the
guides' blocks on a trained run, as pasted).

    python -m pytest -n 0 tests/unit/test_doc_commands.py
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SHELLS = ("bash", "sh", "shell", "console", "")
# files the docs name as the reader's own (a config, a model, a dataset of theirs): no such file is in the repository
READERS_OWN = {"ppo_config.yaml"}


@dataclass(frozen=True)
class Shown:
    """A command line as a page shows it: where, the words, and the error line shown under it ("" when none)."""

    where: str
    words: list[str]
    error: str = ""


def blocks(text: str) -> list[tuple[int, str, str]]:
    """Each fenced block of a page: (its first line's number, its language, its text)."""
    return [(text[: m.start()].count("\n") + 2, m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def shown(path: Path) -> list[Shown]:
    """The command lines of a page's shell blocks (a console block's `$ ` lines, the output after each read for an error)."""
    out = []
    for first, lang, body in blocks(path.read_text()):
        if lang not in SHELLS:
            continue
        lines = body.replace("\\\n", " ").splitlines()
        console = any(line.startswith("$ ") for line in lines)
        if not lang and not console:  # an untyped block that is no console session: a diagram, a listing
            continue
        for k, line in enumerate(lines):
            if console and not line.startswith("$ "):
                continue
            line = line[2:] if console else line
            after = lines[k + 1] if console and k + 1 < len(lines) else ""
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell: a block of output
            for cmd in split_commands(words):
                out.append(Shown(f"{path.relative_to(ROOT)}:{first + k}", cmd, after if after.startswith("error: ") else ""))
    return out


def split_commands(words: list[str]) -> list[list[str]]:
    """A line's commands (split at &&, ||, ; and |), each without its redirections."""
    out, cur = [], []
    skip = False
    for w in [*words, ";"]:
        if skip:
            skip = False
            continue
        if w in ("&&", "||", ";", "|"):
            if cur:
                out.append(cur)
            cur = []
        elif w in (">", ">>", "2>", "<"):
            skip = True
        elif not re.match(r"^\d?>", w):
            cur.append(w)
    return out


def verlj_words(words: list[str]) -> list[str] | None:
    """The verlj arguments of a command line that runs verlj (directly, under torchrun, or by `ray job submit`, after any
    VAR=value it sets); None else."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return None
    if words[0] == "verlj":
        return words[1:]
    if words[0] == "torchrun" and "verlj.cli" in words:
        return words[words.index("verlj.cli") + 1:]
    if words[:3] == ["ray", "job", "submit"] and "--" in words:
        return verlj_words(words[words.index("--") + 1:])
    return None


def example_headers() -> list[Shown]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for k, line in enumerate(path.read_text().splitlines()):
            if not line.startswith("#"):
                break
            cmd = line.lstrip("#").strip()
            if cmd.split(" ", 1)[0] in ("verlj", "torchrun", "python"):
                out.extend(Shown(f"{path.relative_to(ROOT)}:{k + 1}", c) for c in split_commands(shlex.split(cmd, comments=True)))
    return out


ALL = [s for page in PAGES for s in shown(page)] + example_headers()


def check(words: list[str]) -> None:
    """Parse a verlj command line as the CLI does, without running it; then its config, where it has one."""
    import typer

    from verlj.cli.main import app
    from verlj.engine.config import make_config

    group = typer.main.get_command(app)
    cmd, path = group, []
    while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
        path.append(words[0])
        cmd, words = cmd.commands[words[0]], words[1:]
    assert path, f"no verlj command in {words}"
    ctx = cmd.make_context(" ".join(path), list(words))
    params = ctx.params
    overrides = params.get("overrides")
    if overrides is None or not (path[0] in ("train", "whatif", "config") or params.get("fork")):
        return
    config = params.get("config") or params.get("config_file")
    if config is not None and str(config) in READERS_OWN:
        config = None
    make_config(ROOT / config if config is not None else None, list(overrides))


def test_the_docs_show_commands():
    assert len(ALL) > 100 and sum(verlj_words(s.words) is not None for s in ALL) > 80


@pytest.mark.parametrize("cmd", ALL, ids=[s.where for s in ALL])
def test_every_command_the_docs_show_parses_and_its_config_is_valid(cmd):
    verlj = verlj_words(cmd.words)
    if verlj is None:
        if cmd.words[0] in ("python", "python3") and len(cmd.words) > 1 and cmd.words[1].endswith(".py"):
            assert (ROOT / cmd.words[1]).is_file(), f"{cmd.where}: {cmd.words[1]} does not exist"
        return
    if cmd.error:  # a command the docs show failing: it fails, with the line shown
        with pytest.raises(Exception) as e:
            check(verlj)
        assert cmd.error.removeprefix("error: ") in str(e.value), cmd.where
        return
    try:
        check(verlj)
    except Exception as e:  # noqa: BLE001 - say which line of which page
        pytest.fail(f"{cmd.where}: `{shlex.join(cmd.words)}`: {type(e).__name__}: {e}")
