"""The docs cannot drift from the code: the config reference lists every key of engine/config.py with its
comment, the CLI reference every command of the typer app, and the committed pages are what
tools/gen_docs.py generates now. The README stays a two-minute read whose first two commands are the
set-up and CI's test command, and its links (and CONTRIBUTING.md's) point at files that exist.

    python -m pytest -n 0 tests/unit/test_docs.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_docs():
    return _load(ROOT / "tools" / "gen_docs.py", "gen_docs")


def _leaf_keys(cls, prefix=""):
    """Every leaf key of the config, walked here independently of the generator."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_config_reference_lists_every_key_with_its_comment(gen_docs):
    from verlj.engine import config

    page = gen_docs.config_reference(config)
    keys = list(_leaf_keys(config.Config))
    assert len(keys) > 80
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_.]+)` \|.*$", page, re.M)}
    assert sorted(rows) == sorted(keys)
    for key in keys:
        doc = rows[key].rstrip(" |").rsplit(" | ", 1)[1]
        assert len(doc) > 5, key
    # a comment above the field and one at the end of its line both reach the page
    assert "the per-step state fingerprint: sum64" in rows["trainer.state_digest"]
    assert "training steps (one step = one rollout batch and its update)" in rows["trainer.total_steps"]
    assert "| live (`--allow-config-change`) | ✓ |" in rows["model.actor.optim.lr"]
    assert "| topology (resharded) |" in rows["distributed.zero_stage"]
    assert "inside the last &lt;answer&gt;&lt;/answer&gt;" in rows["rollout.answer_format"]  # not swallowed as HTML


def test_a_config_key_without_a_comment_is_refused(gen_docs, tmp_path):
    src = tmp_path / "undocumented_config.py"
    src.write_text(
        "from dataclasses import dataclass, field\n\n\n"
        "@dataclass\nclass Inner:\n    documented: int = 1  # says what it does\n    bare: int = 2\n\n\n"
        "@dataclass\nclass Config:\n    inner: Inner = field(default_factory=Inner)\n\n"
        "    def to_dict(self):\n        import dataclasses\n        return dataclasses.asdict(self)\n\n\n"
        "POLICIES = {'inner.documented': 'fixed', 'inner.bare': 'fixed'}\n"
    )
    module = _load(src, "undocumented_config")
    with pytest.raises(gen_docs.UndocumentedKey, match=r"inner\.bare") as e:
        gen_docs.config_reference(module)
    assert "inner.documented" not in str(e.value)


def test_cli_reference_lists_every_command(gen_docs):
    import typer

    from verlj.cli.main import app

    page = gen_docs.cli_reference(app)
    root = typer.main.get_command(app)
    names = []
    for name, cmd in root.commands.items():
        names.append(name)
        names += [f"{name} {sub}" for sub in getattr(cmd, "commands", {})]
    assert {"train", "verify", "inspect", "replay", "whatif", "config show"} <= set(names)
    for name in names:
        assert f"## `verlj {name}`" in page, name
    assert "| `--output-dir` / `--output_dir` / `-o` | option, required |" in page
    assert "probe/&lt;module.function&gt;/&lt;name&gt;" in page


def test_committed_docs_are_what_the_code_generates(gen_docs):
    stale = [str(p.relative_to(ROOT)) for p in gen_docs.stale()]
    assert not stale, f"{', '.join(stale)} differ from the code: run python tools/gen_docs.py"


def test_readme_is_short_and_opens_with_the_setup_and_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert commands[0].startswith("python3 -m venv .venv && ") and commands[0].endswith(" && verlj train --output-dir runs/demo")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1] == ci
    assert "mkdocs build --strict" in ci and "lint-imports" in ci and ci.endswith("python -m pytest")


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_relative_links_point_at_files_that_exist(name):
    text = (ROOT / name).read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert links
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing
