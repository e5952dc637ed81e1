"""The code stays readable: no function in engine/, journal/ or cli/ longer than a screen and a half, no module
over 700 lines, no class over 30 methods."""

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


RL = ENGINE / "rl"
TRAINER_LINES = 450  # the trainer chooses a rollout source and applies steps; the rest lives beside it
ROOM_LINES = 700  # a module of the rollout seam


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_trainer_only_orchestrates_and_each_rollout_source_fits_a_room():
    """rl/trainer.py stays under TRAINER_LINES and reaches the sources only through the package's
    make_source (a new source plugs in without touching it); every module of rl/sources/ fits a room.
    The function-size rule above covers the seam too (it walks engine/)."""
    trainer = RL / "trainer.py"
    assert lines(trainer) <= TRAINER_LINES, f"rl/trainer.py has {lines(trainer)} lines (at most {TRAINER_LINES})"
    sources = sorted((RL / "sources").glob("*.py"))
    assert {p.stem for p in sources} >= {"__init__", "base", "players", "sync", "planned", "completion", "single", "env_players"}
    big = [f"{p.name} ({lines(p)} lines)" for p in sources if lines(p) > ROOM_LINES]
    assert not big, f"rollout sources over {ROOM_LINES} lines: " + "; ".join(big)
    reached = {node.module for node in ast.walk(ast.parse(trainer.read_text())) if isinstance(node, ast.ImportFrom)
               and node.level and node.module and node.module.split(".")[0] == "sources"}
    assert reached == {"sources"}, f"rl/trainer.py imports a source's own module: {sorted(reached - {'sources'})}"


FILE_LINES = 700  # one concept per module
LONG_ALLOWED = {"engine/config.py"}  # every config section's documented fields, in one place (docs/reference/config.md)
MAX_METHODS = 30  # a class with more has grown into a hub: split it along its seams, one object each
PACKAGES = (("engine", 20), ("journal", 10), ("cli", 5))  # and how many modules each has at least


def long_modules(root: Path, limit: int, allowed: set[str] = frozenset()) -> list[str]:
    """'path (N lines)' for every module under `root` longer than `limit` lines, but those in `allowed`
    (paths from the repository root)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel not in allowed and (n := lines(path)) > limit:
            out.append(f"{rel} ({n} lines)")
    return out


def hub_classes(root: Path, limit: int) -> list[str]:
    """'path:line Class (N methods)' for every class under `root` that defines more than `limit` methods
    in its own body (its nested classes count for themselves)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > limit:
                    out.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno} {node.name} ({n} methods)")
    return out


def test_no_module_in_engine_journal_or_cli_is_over_700_lines():
    """One concept per module: engine/, journal/ and cli/ files stay under 700 lines (config.py aside: the
    config's documented fields) — store, frames, segment_file, shipper, compaction, segments: not one
    1,255-line segments.py."""
    long = []
    for name, least in PACKAGES:
        assert len(list((ROOT / name).rglob("*.py"))) > least  # it looked where the package is
        long += long_modules(ROOT / name, FILE_LINES, LONG_ALLOWED)
    assert not long, f"modules over {FILE_LINES} lines (split them along a seam): " + "; ".join(long)


def test_no_class_in_engine_journal_or_cli_has_over_30_methods():
    """A hub split along its seams (the journal: its store, writer, meta, retention, pending, shipping; the
    ledger: identity, lineage, snapshots, retention, in flight), one object owning each concern."""
    hubs = [h for name, _least in PACKAGES for h in hub_classes(ROOT / name, MAX_METHODS)]
    assert not hubs, f"classes with over {MAX_METHODS} methods (split them along their seams): " + "; ".join(hubs)


def test_the_counts_find_a_long_module_and_a_hub(tmp_path):
    (tmp_path / "pkg").mkdir()
    methods = "\n".join(f"    def m{i}(self):\n        pass\n" for i in range(31))
    (tmp_path / "pkg" / "hub.py").write_text(f"class Hub:\n{methods}\n\nclass Small:\n    def a(self):\n        pass\n")
    (tmp_path / "pkg" / "config.py").write_text("x = 1\n" * 701)
    assert hub_classes(tmp_path / "pkg", MAX_METHODS) == ["pkg/hub.py:1 Hub (31 methods)"]
    assert long_modules(tmp_path / "pkg", FILE_LINES) == ["pkg/config.py (701 lines)"]
    assert long_modules(tmp_path / "pkg", FILE_LINES, {"pkg/config.py"}) == []
