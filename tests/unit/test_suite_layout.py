"""The suite collects, and its two tiers hold. tests/ has no __init__.py files, so pytest imports each test
module by its basename, and two test files of one name in different folders stop the whole collection
("import file mismatch"), which no targeted run of either file shows. The slow tier is tests/conftest.py's
measured SECONDS: every test module is measured there and every name there exists. The everyday tier
(`python -m pytest -m "not slow"`) imports every module of engine/, journal/ and cli/.

    python -m pytest -n 0 tests/unit/test_suite_layout.py
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PACKAGES = {"verlj.engine": REPO / "engine", "verlj.journal": REPO / "journal", "verlj.cli": REPO / "cli"}


def repeated_basenames(root: Path) -> list[str]:
    names = Counter(p.name for p in root.rglob("test_*.py"))
    return sorted(n for n, k in names.items() if k > 1)


def test_no_two_test_files_share_a_name():
    assert repeated_basenames(TESTS) == []


def test_the_check_finds_a_repeated_name(tmp_path):
    for folder in ("unit", "integration"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_same.py").write_text("")
    assert repeated_basenames(tmp_path) == ["test_same.py"]


# ----------------------------------------------------------------------------- the measured list


def suite_conftest():
    """tests/conftest.py (under a name of its own: pytest has loaded it as `conftest`, as tests/integration's)."""
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_module_is_measured_and_every_module_measured_exists():
    files = {p.name for p in TESTS.rglob("test_*.py")}
    seconds = suite_conftest().SECONDS
    assert not sorted(files - set(seconds)), (f"not in tests/conftest.py's SECONDS: {sorted(files - set(seconds))}; measure "
                                              "them (python -m pytest -n 0 FILE --measure-seconds /tmp/s.json) and add them")
    assert not sorted(set(seconds) - files), f"SECONDS names {sorted(set(seconds) - files)}, which are no test modules"


def test_a_module_over_the_threshold_is_slow_and_the_rest_is_not():
    tiers = suite_conftest()
    tiers.SECONDS.update({"test_a.py": tiers.SLOW_SECONDS + 1, "test_b.py": tiers.SLOW_SECONDS})
    assert tiers.slow("tests/integration/test_a.py::test_x[1-2/3]") and tiers.slow("tests/integration/test_a.py::test_y")
    assert not tiers.slow("tests/integration/test_b.py::test_x") and not tiers.slow("tests/unit/test_unmeasured.py::test_x")


# ----------------------------------------------------------------------------- every module in the everyday tier


def product_modules() -> dict[str, Path]:
    """verlj.engine..., verlj.journal..., verlj.cli... -> their files."""
    out = {}
    for name, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join([name, *parts[:-1]] if parts[-1] == "__init__" else [name, *parts])] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> tuple[set[str], set[tuple[str, str]]]:
    """What an import statement in `package` imports: the modules (`from m import x` counts `m.x` too, in case it
    is a submodule) and the (module, name) pairs it takes by name."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}, set()
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    return {module} | {f"{module}.{alias.name}" for alias in node.names}, {(module, alias.name) for alias in node.names}


@functools.cache  # each file read once for the whole check
def imports(path: Path, package: str, everywhere: bool) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """The modules `path` imports (package: its own, for relative imports; `a.b.c` brings `a` and `a.b`), and the
    (module, name) pairs it imports by name. everywhere=True: wherever the statement is (test code: what its
    tests may run), and a string "verlj.cli" is `python -m verlj.cli`; else only what runs when it is imported:
    its top-level statements and the bodies of its own functions that they call (cli.main's _register()).
    Never what is under `if TYPE_CHECKING:`."""
    tree = _parsed(path)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called = [functions[n.value.func.id] for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
              and isinstance(n.value.func, ast.Name) and n.value.func.id in functions]
    modules: set[str] = set()
    names: set[tuple[str, str]] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            children = node.orelse
        elif not everywhere and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            children = node.body if node in called else []
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found, named = _targets(node, package)
            modules.update(found)
            names.update(named)
        elif everywhere and isinstance(node, ast.Constant) and node.value == "verlj.cli":
            modules.add("verlj.cli.__main__")
        for child in children:
            visit(child)

    for node in tree.body:
        visit(node)
    return frozenset(".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2)), frozenset(names)


def called_imports(module: str, name: str, product: dict[str, Path]) -> set[str]:
    """What the function `name` of the product module `module`, where it is one, imports in its body: a test that
    imports a function calls it (run.train imports the checkpointer there)."""
    path = product[module]
    for node in _parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return set().union(*(_targets(n, _package(module, path))[0] for n in ast.walk(node)
                                 if isinstance(n, (ast.Import, ast.ImportFrom))))
    return set()


def code_modules(root: Path) -> dict[str, Path]:
    """The modules of the tests' code under `root`, by the names they are imported as: a file in a folder of its own
    on sys.path (tests/, tests/unit/, tests/integration/: no __init__.py) by its stem, one in a package under those
    (tests/harness/) by its dotted name (`harness.processes`, `harness` for its __init__.py)."""
    out = {}
    for path in root.rglob("*.py"):
        if path.name == "conftest.py":
            continue
        parts, folder = [] if path.name == "__init__.py" else [path.stem], path.parent
        while (folder / "__init__.py").is_file():
            parts.insert(0, folder.name)
            folder = folder.parent
        out[".".join(parts)] = path
    return out


def loaded_by(test_file: Path, product: dict[str, Path]) -> set[str]:
    """The product modules that importing `test_file` and running its tests imports, in this process or in the
    `verlj` processes it starts: what the test file and the tests/ helpers it uses import anywhere, and what
    the product functions they import by name import in their bodies; then, transitively, what each module
    imported runs when it is imported."""
    code = code_modules(TESTS)
    helpers = {name for name in code if not name.rpartition(".")[2].startswith("test_")}
    found, by_name = imports(test_file, "", everywhere=True)
    seen: set[str] = set()
    todo = list(found)
    while todo or by_name:
        if not todo:  # then what the functions taken by name import when called
            todo = [m for module, name in sorted(by_name) if module in product for m in called_imports(module, name, product)]
            by_name = frozenset()
            continue
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module in product:
            todo.extend(imports(product[module], _package(module, product[module]), everywhere=False)[0])
        elif module in code:
            found, named = imports(code[module], _package(module, code[module]), everywhere=module in helpers)
            todo.extend(found)
            by_name |= named if module in helpers else frozenset()
    return seen & set(product)


def not_imported(test_files: list[Path], product: dict[str, Path]) -> list[str]:
    loaded = set().union(*(loaded_by(f, product) for f in test_files))
    return sorted(set(product) - loaded)


def test_the_everyday_tier_imports_every_module_of_engine_journal_and_cli():
    tiers = suite_conftest()
    everyday = [p for p in sorted(TESTS.rglob("test_*.py")) if tiers.SECONDS.get(p.name, 0) <= tiers.SLOW_SECONDS]
    missing = not_imported(everyday, product_modules())
    assert not missing, f"no test module of the everyday tier (-m 'not slow') imports {missing}"


def test_the_tests_code_is_named_as_it_is_imported(tmp_path):
    for path in ("verlj_testing.py", "unit/test_x.py", "harness/__init__.py", "harness/processes.py", "harness/deep/__init__.py",
                 "harness/deep/server.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "conftest.py").write_text("")
    assert sorted(code_modules(tmp_path)) == ["harness", "harness.deep", "harness.deep.server", "harness.processes", "test_x", "verlj_testing"]
    assert {"harness", "harness.processes", "harness.forkserver", "harness.forkclient"} <= set(code_modules(TESTS))  # the suite's harness


def test_the_import_check_follows_what_an_import_runs_and_finds_what_nothing_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import used\n")
    (pkg / "used.py").write_text("from .config import X\n\ndef later():\n    from . import lazy\n\ndef run():\n    from . import ran\n")
    (pkg / "config.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import hinted\nX = 1\n")
    (pkg / "main.py").write_text("def _register():\n    from . import registered\n\n_register()\n")
    for name in ("lazy", "hinted", "registered", "ran", "alone"):
        (pkg / f"{name}.py").write_text("")
    product = {f"verlj.pkg.{p.stem}" if p.stem != "__init__" else "verlj.pkg": p for p in pkg.glob("*.py")}
    test = tmp_path / "test_x.py"
    test.write_text("def test_it():\n    from verlj.pkg import main\n    from verlj.pkg.used import run\n")
    assert not_imported([test], product) == ["verlj.pkg.alone", "verlj.pkg.hinted", "verlj.pkg.lazy"]


# ----------------------------------------------------------------------------- one name, one module in engine/

def repeated_module_names(root: Path) -> dict[str, list[str]]:
    """name -> the modules under `root` that share it (a module's file name without .py, a package's folder name),
    for each name two or more share."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            found.setdefault(path.stem, []).append(path.relative_to(root).as_posix())
        elif path.parent != root:
            found.setdefault(path.parent.name, []).append(path.parent.relative_to(root).as_posix() + "/")
    return {name: places for name, places in found.items() if len(places) > 1}


def test_every_module_of_engine_has_a_name_of_its_own():
    """A module is named once in engine/ (loop.pruning beside ledger.retention, view.answers and view.http beside
    rl.data and rl.gateway.server, post_mortem.counterfactual beside loop.whatif, gateway.token_ledger beside
    loop.ledger, sources.agent_players beside gateway.agents): a name says which room it is."""
    assert repeated_module_names(REPO / "engine") == {}


def test_the_check_finds_a_repeated_module_name(tmp_path):
    for path in ("a/x.py", "b/x.py", "c/x/__init__.py", "b/y.py", "__init__.py", "a/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert repeated_module_names(tmp_path) == {"x": ["a/x.py", "b/x.py", "c/x/"]}
