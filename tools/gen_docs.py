"""Generate the docs pages that must not drift from the code: the config reference (every key of
engine/config.py, with the comment that documents it), the CLI reference (every command of the typer app,
with its help and parameters), and the copies of the example images the docs site shows.

    python tools/gen_docs.py            # write docs/reference/config.md, docs/reference/cli.md, docs/img/*.png
    python tools/gen_docs.py --check    # exit 1, naming the files, when a committed page differs from the code

A config key whose field has no comment (on its line, or in the comment lines right above it) is an
error: the generator names it and writes nothing. tests/unit/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
IMAGES = {ROOT / "examples" / name: ROOT / "docs" / "img" / name for name in ("grpo_reasoning_gym.png", "whatif.png")}

POLICY_WORDS = {
    "fixed": "fixed",
    "live": "live (`--allow-config-change`)",
    "bookkeeping": "bookkeeping (any resume)",
    "topology": "topology (resharded)",
}


class UndocumentedKey(Exception):
    """A config field without a comment: the reference would have nothing to say about it."""


# ----------------------------------------------------------------------------- the config reference


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment: the comment lines right above its line, then
    the comment at the end of its line, joined into one paragraph."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            line = stmt.lineno - 1
            while line in comments and line not in code_lines:  # a comment block of its own, right above
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments and n in code_lines]
            text = " ".join(above + trailing).strip()
            if text:
                out[(node.name, stmt.target.id)] = text
    return out


def config_keys(cls, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """Every leaf key of a config dataclass, dotted, in declaration order, with the class that declares it."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(config_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", cls, f))
    return out


def _type_name(tp) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and issubclass(tp, str):  # a choice (config.Choice): its YAML is a string
        return "str"
    if isinstance(tp, type) and not isinstance(tp, types.GenericAlias):
        return tp.__name__
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (_type_name(rest[0]) if len(rest) == 1 else " or ".join(map(_type_name, rest))) + " or null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(map(_type_name, args))
    return str(tp).replace("typing.", "")


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _text(text: str) -> str:
    """Prose for a Markdown page: `<` and `>` outside code spans escaped, so that `<answer>` is not taken
    for an HTML tag and dropped."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _cell(text: str) -> str:
    """A table cell: prose, with its pipes escaped."""
    return _text(text).replace("|", "\\|")


def config_reference(module) -> str:
    """The config reference page of a config module (engine/config.py): every leaf key of its `Config`,
    grouped by section, with type, default, resume policy and the comment that documents it."""
    comments = field_comments(inspect.getsource(module))
    cfg = module.Config
    defaults = cfg().to_dict()
    policies = module.POLICIES
    whatif = set(getattr(module, "WHATIF_KEYS", ()))
    legacy = getattr(module, "LEGACY_VALUES", {})
    keys = config_keys(cfg)
    missing = [key for key, owner, f in keys if (owner.__name__, f.name) not in comments]
    if missing:
        raise UndocumentedKey(f"config key(s) without a comment in {Path(module.__file__).name}: {', '.join(missing)} "
                              "(a field's comment, on its line or right above it, is its documentation)")

    lines = [
        "# Config reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the comments of engine/config.py: do not edit by hand. -->",
        "",
        "Every key of a verlj config, with its default. Set them in a YAML file (`--config`) or as dotted",
        "overrides on the command line (`verlj train -o RUN trainer.total_steps=40`); `verlj config show` prints",
        "the effective config. A wrong key, type or value ends with one sentence naming it, exit code 2.",
        "",
        "**On resume** is the key's resume policy, declared on the field in `engine/config.py` and applied by one",
        "function (`check_change`) for `--resume` and `replay --fork` alike (see [Recovery](../concepts/recovery.md)):",
        "",
        "- *fixed*: shapes the engines, the data or the random streams; never changes within a run;",
        "- *live*: read by the trainer every step; changes on resume with `--allow-config-change` (recorded), or on fork;",
        "- *bookkeeping*: shapes only the future or the logs; changes on any resume, and is left out of the config hash;",
        "- *topology*: how the state is laid out over the ranks; changes on any resume, the snapshot resharded",
        "  (see [Resharding](../guides/resharding.md)).",
        "",
        "**What-if**: ✓ marks the keys `verlj whatif` may change besides bookkeeping ones (`WHATIF_KEYS`; see",
        "[What-if](../guides/whatif.md)).",
        "",
    ]
    sections: dict[str, list[str]] = {}  # the section of a key (its dotted parent), in order of first appearance
    for key, owner, f in keys:
        section = key.split(".")[0] if key.count(".") < 2 else key.rsplit(".", 1)[0]
        value = defaults
        for part in key.split("."):
            value = value[part]
        doc = comments[(owner.__name__, f.name)]
        if key in legacy:
            doc += f" (a run made before this key existed reads it as `{_value(legacy[key])}`)"
        tp = _type_name(typing.get_type_hints(owner)[f.name])
        sections.setdefault(section, []).append(
            f"| `{key}` | {_cell(tp)} | `{_value(value)}` | {POLICY_WORDS[policies[key]]} | {'✓' if key in whatif else ''} | {_cell(doc)} |")
    for section, rows in sections.items():
        lines += ["", f"## `{section}`", "", "| key | type | default | on resume | what-if | what it does |", "|---|---|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the CLI reference


def _param_row(p) -> str:
    if p.param_type_name == "argument":
        name = f"`{(p.metavar or p.name).upper()}`" + (" …" if p.nargs == -1 else "")
        kind = "argument" + ("" if p.required else ", optional")
    else:
        names = [*p.opts, *p.secondary_opts]
        name = " / ".join(f"`{n}`" for n in names)
        kind = "flag" if p.is_flag else "option"
        if p.required:
            kind += ", required"
        elif not p.is_flag and p.default is not None and p.default != () and p.show_default is not False:
            default = p.default.value if isinstance(p.default, enum.Enum) else p.default  # a choice: as it is typed
            kind += f", default `{_cell(str(default))}`"
    return f"| {name} | {kind} | {_cell(' '.join((p.help or '').split()))} |"


def _commands(group, path: list[str]):
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if cmd.hidden:
            continue
        yield [*path, name], cmd
        if hasattr(cmd, "commands"):  # a group (typer carries its own click)
            yield from _commands(cmd, [*path, name])


def _guide_links(text: str) -> str:
    """A help text's plain `docs/guides/NAME.md` (what `--help` prints) as a link on the page."""
    return re.sub(r"\bdocs/guides/([\w-]+)\.md\b", r"[docs/guides/\1.md](../guides/\1.md)", text)


def cli_reference(app) -> str:
    """The CLI reference page of a typer app: every command (sub-commands included), its help text, its
    arguments and options, as `verlj COMMAND --help` gives them."""
    import typer

    root = typer.main.get_command(app)
    lines = [
        "# CLI reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the typer app (cli/): do not edit by hand. -->",
        "",
        f"{_text(' '.join((root.help or '').split()))} `verlj --help` lists the commands and `verlj COMMAND --help`",
        "prints one of these sections. Every command that fails prints one line (`error: …`) and exits non-zero.",
        "",
        "**Exit codes**, one rule for every command: **0** it did what was asked; **2** what it was given cannot be used, "
        "before anything runs: the command line (an option's value, steps or a metric the run does not have, an output inside a "
        "run's directory, an extra a flag needs that is not installed), a config key or value, or code the config names "
        "(`rollout.env`, `rollout.agent`, `rollout.reward_fn`, `trainer.checkpoint_policy`, `--probe`) that cannot be imported, "
        "made or called as it must be; "
        "**1** it ran and failed, or found what it was asked to look for: user code that raised or answered wrongly while it "
        "ran, a training step past `rollout.max_fault_rate` (nothing of it committed), a run directory, journal or snapshot "
        "that cannot be used, two runs that differ (`diff`), a step that did not reproduce (`rerun`). `verify` keeps 1 for "
        "damage: a path that is no run at all (missing, or without a journal) is a wrong argument to it, 2. A process killed by a "
        "signal exits as the signal says (a SIGKILL: -9 to Python's subprocess, 137 to a shell).",
        "",
    ]
    for path, cmd in _commands(root, []):
        lines += ["", f"## `verlj {' '.join(path)}`", ""]
        if cmd.help:
            lines += [_guide_links(_text(inspect.cleandoc(cmd.help))), ""]
        if hasattr(cmd, "commands"):
            subs = [n for n in sorted(cmd.commands) if not cmd.commands[n].hidden]
            lines += [f"Sub-commands: {', '.join(f'`{n}`' for n in subs)}.", ""]
            continue
        params = [p for p in cmd.params if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            lines += ["| parameter | kind | what it does |", "|---|---|---|", *(_param_row(p) for p in params), ""]
        if cmd.epilog:
            lines += [_text(" ".join(cmd.epilog.split())), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------- the pages


def generated() -> dict[Path, bytes]:
    """Every generated file of the docs, path -> the bytes it should hold."""
    sys.path.insert(0, str(ROOT))
    from verlj.cli.main import app
    from verlj.engine import config

    out = {CONFIG_PAGE: config_reference(config).encode(), CLI_PAGE: cli_reference(app).encode()}
    for src, dst in IMAGES.items():
        out[dst] = src.read_bytes()
    return out


def stale() -> list[Path]:
    """The generated files whose committed bytes differ from what the code generates now."""
    return [path for path, data in generated().items() if not path.exists() or path.read_bytes() != data]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page differs from what the code generates")
    args = parser.parse_args()
    try:
        pages = generated()
    except UndocumentedKey as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.check:
        bad = [p for p, data in pages.items() if not p.exists() or p.read_bytes() != data]
        for p in bad:
            print(f"{p.relative_to(ROOT)} differs from the code: run python tools/gen_docs.py", file=sys.stderr)
        return 1 if bad else 0
    for path, data in pages.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
