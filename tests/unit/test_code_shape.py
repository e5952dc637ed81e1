"""The code stays readable: no function in engine/, journal/ or cli/ longer than a screen and a half."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
MAX_LINES = 80


def long_functions(root: Path, limit: int) -> list[str]:
    """'path:line name (N lines)' for every function or method under `root` longer than `limit`
    lines, its decorators and docstring included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - start + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_engine_function_is_over_80_lines():
    assert ENGINE.is_dir() and len(list(ENGINE.rglob("*.py"))) > 20  # it looked where the engine is
    offenders = long_functions(ENGINE, MAX_LINES)
    assert not offenders, f"functions in engine/ over {MAX_LINES} lines (split them by what they do): " + "; ".join(offenders)


def test_no_journal_or_cli_function_is_over_80_lines():
    for name, least in (("journal", 10), ("cli", 5)):
        assert len(list((ROOT / name).rglob("*.py"))) > least  # it looked where the package is
        offenders = long_functions(ROOT / name, MAX_LINES)
        assert not offenders, f"functions in {name}/ over {MAX_LINES} lines (split them by what they do): " + "; ".join(offenders)


def test_the_count_finds_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    @staticmethod\n    def long():\n{body}\n")
    assert long_functions(tmp_path / "pkg", MAX_LINES) == ["pkg/m.py:7 long (82 lines)"]


def test_no_journal_or_cli_module_is_over_700_lines():
    """One concept per module: journal/ and cli/ files stay under 700 lines (store, frames, segment_file,
    shipper, compaction, segments: not one 1,255-line segments.py)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for name in ("journal", "cli") for p in sorted((ROOT / name).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 700]
    assert not long, "modules over 700 lines (split them along a seam): " + "; ".join(long)
