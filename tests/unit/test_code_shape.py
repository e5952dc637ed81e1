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


# ----------------------------------------------------------------------------- nothing wired after construction

# Library objects verlj sets by their documented (or only) way, each with the reason: not collaborators of verlj's own.
LIBRARY_SETS = {
    "engine/dist.py": {"comm.build_shm_op": "DeepSpeed's CPU shm op, turned off before it is built (gloo ranks)"},
    "engine/rl/gateway/agents.py": {"record.msg": "a logging.LogRecord the agent's log filter rewrites",
                                    "record.verlj_tagged": "the same LogRecord, marked once"},
    "engine/rl/models.py": {"tk.pre_tokenizer": "a tokenizers.Tokenizer being built", "tk.decoder": "the same",
                            "tok.pad_token": "transformers' documented way to give a tokenizer its pad token",
                            "model.config.use_cache": "a transformers config", "model.config.pad_token_id": "the same"},
    "engine/rl/vllm_engine.py": {"model.load_weights": "vLLM's model patched to take pushed weights",
                                 "model_config.max_position_embeddings": "vLLM's model config"},
    "engine/rl/workers.py": {"engine.enable_backward_allreduce": "DeepSpeed's documented switch for gradient accumulation",
                             "inner.param_groups": "torch optimizer param groups swapped for one step",
                             "master.grad": "a torch tensor's grad", "p.grad": "a torch tensor's grad"},
    "engine/state/reshard.py": {"engine._config.load_universal_checkpoint": "DeepSpeed's flag for a universal load",
                                "engine.global_steps": "DeepSpeed's counters, put back after a universal load",
                                "engine.global_samples": "the same", "engine.skipped_steps": "the same"},
    "engine/state/safe_load.py": {"engine.checkpoint_engine": "DeepSpeed's checkpoint engine, replaced by the safe loader"},
}


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _targets(node: ast.AST) -> list[ast.AST]:
    found = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    return [t for target in found for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "dataclass" or isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass"
               for d in cls.decorator_list)


def record_fields(roots: list[Path]) -> tuple[set[str], set[str]]:
    """(every field of a dataclass under `roots`, those of them declared as a collaborator: annotated with a
    class of the code that is no record, enum or tuple, or with a Callable)."""
    classes: dict[str, bool] = {}  # name -> whether it is a value (a record, an enum, a tuple)
    annotations: list[tuple[str, ast.AST]] = []
    for root in roots:
        for path in root.rglob("*.py"):
            for cls in ast.walk(ast.parse(path.read_text())):
                if isinstance(cls, ast.ClassDef):
                    bases = {getattr(b, "id", getattr(b, "attr", None)) for b in cls.bases}
                    classes[cls.name] = _is_dataclass(cls) or bool(bases & {"Enum", "IntEnum", "NamedTuple", "Record", "TypedDict", "str"})
                    if _is_dataclass(cls):
                        annotations += [(b.target.id, b.annotation) for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
    collaborators = set()
    for name, annotation in annotations:
        used = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
        if "Callable" in used or any(classes.get(u) is False for u in used):
            collaborators.add(name)
    return {name for name, _ in annotations}, collaborators


def wirings(root: Path, fields: set[str], collaborators: set[str], allowed: dict[str, dict[str, str]]) -> list[str]:
    """'path:line target (why)' for each assignment under `root` that sets an attribute of another object than
    self: unless it fills in a record's field that is no collaborator (a result being made), or sets a library
    object `allowed` names. A write through one of self's collaborators (self.x.y = ..., x given to __init__) counts."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text())
        modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        given: dict[ast.AST, set[str]] = {}  # a method -> the attributes its class sets from __init__'s parameters
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            init = next((b for b in cls.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"} if init else set()
            names = set()
            for n in ast.walk(init) if init else ():
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        pairs = zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) else [(t, n.value)]
                        names |= {c[1] for tt, v in pairs if (c := _chain(tt)) and len(c) == 2 and c[0] == "self" and isinstance(v, ast.Name) and v.id in params}
            for f in ast.walk(cls):
                given[f] = names
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(func):
                for target in _targets(node):
                    c = _chain(target)
                    if not c or len(c) < 2 or c[0] in modules or ".".join(c) in allowed.get(rel, {}):
                        continue
                    if c[0] in ("self", "cls"):
                        why = "through a collaborator" if len(c) >= 3 and c[1] in given.get(func, set()) else None
                    else:
                        why = "deep" if len(c) >= 3 else "not a record's field" if c[1] not in fields else "a collaborator" if c[1] in collaborators else None
                    if why:
                        out.append(f"{rel}:{node.lineno} {'.'.join(c)} ({why})")
    return sorted(set(out))


def test_nothing_is_wired_after_construction():
    """An object's collaborators are given when it is made (a player its engine and durable log, the run its
    source, the journal its shipped layout): no code sets one on another object later (trainer.in_flight_log = ...,
    run.trainer.keep_stages = ..., ckpt.loaded_fingerprint = ...). Filling in a record being made is not wiring; a
    library object set the library's way is named in LIBRARY_SETS with its reason."""
    roots = [ROOT / name for name, _least in PACKAGES]
    fields, collaborators = record_fields(roots)
    assert {"trainer", "source", "ledger"} <= collaborators and "step" in fields - collaborators  # it read the records
    found = [w for root in roots for w in wirings(root, fields, collaborators, LIBRARY_SETS)]
    assert not found, "set after construction (give it to the constructor, or return it): " + "; ".join(found)
    unused = {f"{path} {name}" for path, names in LIBRARY_SETS.items() for name in names
              if f".{name.split('.', 1)[1]} =" not in (ROOT / path).read_text() and f".{name.split('.', 1)[1]}," not in (ROOT / path).read_text()}
    assert not unused, f"LIBRARY_SETS names what its module no longer sets: {sorted(unused)}"


def test_the_check_finds_wiring(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from dataclasses import dataclass\n\n\nclass Engine:\n    pass\n\n\n@dataclass\nclass Result:\n    step: int\n    engine: Engine\n\n\n"
        "class Owner:\n    def __init__(self, engine, n):\n        self.engine, self.n = engine, n\n\n"
        "    def go(self, other, res, lib):\n        self.n = 2\n        res.step = 3\n        other.log = self.engine\n"
        "        res.engine = self.engine\n        self.engine.size = 4\n        a.b.c = 5\n        lib.flag = 1\n")
    fields, collaborators = record_fields([pkg])
    assert fields == {"step", "engine"} and collaborators == {"engine"}
    assert wirings(pkg, fields, collaborators, {"pkg/m.py": {"lib.flag": "a library's"}}) == [
        "pkg/m.py:21 other.log (not a record's field)", "pkg/m.py:22 res.engine (a collaborator)",
        "pkg/m.py:23 self.engine.size (through a collaborator)", "pkg/m.py:24 a.b.c (deep)"]
