"""`verlj verify DIR --against RUN`: is every row of an SFT or DPO export what the run's journal holds?

    verlj verify sft/ --against runs/grpo           # exit 0: every row checks; 1: names each row that does not
    verlj verify sft/ --against runs/grpo --json

Checks, reading only, in one streaming pass: the manifest names this run (its creation time and config hash) and
the journal still holds the exported steps' chain as it was; every file the manifest lists is there with its size,
rows and BLAKE3 digest, and no file is there that it does not list; then every row, file by file in order, against
the rows the manifest's filter makes from the journal now (the same code as the export: ``distill.Rows``): a row
whose columns differ (text, token ids, log-probs, scores, lineage), a row the journal holds no sample for or the
filter would not make, a row the export lacks, a row out of order or twice, a row of a step damaged now.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from verlj.journal import JournalError

from ..errors import RunError
from ..loop.ledger import Ledger, open_run
from ..schema.events import StepEvents
from ..schema.record import Record
from ..schema.sample import Columns
from ..state.manifest import file_digest
from .distill import KEYS, SFT, Rows, Spec, row_key
from .distill_files import MANIFEST, FileEntry, Recorded, file_rows, read_manifest
from .views import _view

MAX_SHOWN = 50  # rows named one by one; past that, counted


@dataclass
class ExportReport(Record):
    """What `verify EXPORT_DIR` found; `to_dict()` is its JSON (`--json`)."""

    path: str
    run: str
    kind: str = ""
    lines: list[str] = field(default_factory=list)  # "✓ ..." / "✗ ..." / "note: ..."
    problems: list[str] = field(default_factory=list)  # a row (or a file) a line each, the first MAX_SHOWN
    unshown: int = 0  # problems past MAX_SHOWN
    rows: int = 0  # rows read from the files
    bad_rows: int = 0
    ok: bool = True

    def problem(self, line: str, row: bool = True) -> None:
        self.ok = False
        self.bad_rows += row
        if len(self.problems) < MAX_SHOWN:
            self.problems.append(line)
        else:
            self.unshown += 1


def _where(kind: str, key: tuple) -> str:
    return f"step {key[0]}, sample {key[1]}" if kind == SFT else f"step {key[0]}, pair {key[1]} over {key[2]}"


def same(a, b) -> bool:
    """Equal as values (NaN equals NaN; a list, a map compared item by item)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def differing(got: dict, want: dict) -> list[str]:
    """The columns where a row differs from the journal's (missing or extra ones too)."""
    return [k for k in [*want, *(k for k in got if k not in want)] if k not in got or k not in want or not same(got[k], want[k])]


def verify_export(path: Path, run_dir: Path) -> ExportReport:
    path, run_dir = Path(path), Path(run_dir)
    m = read_manifest(path)
    rep = ExportReport(str(path), str(run_dir), m.kind)
    named = m.run
    with open_run(run_dir) as ledger:
        here = _view(Recorded, ledger.identity.all())
        if (here.created, here.config_hash) != (named.created, named.config_hash):
            rep.ok = False
            rep.lines.append(f"✗ {path} was exported from another run (made {named.created}, config hash {named.config_hash}); "
                             f"{run_dir} was made {here.created}, config hash {here.config_hash}")
            return rep
        rep.lines.append(f"✓ the manifest names this run (made {here.created}, config hash {here.config_hash})")
        _check_chain(rep, ledger, m.filter, named.last_step_chain)
        _check_files(rep, path, m.files)
        made = Rows(ledger, named.name, m.filter)
        _check_rows(rep, made, _rows_of(path, m.data, m.format), ledger)
        for step in sorted(set(made.left_out.damaged) - set(m.left_out.damaged)):
            rep.ok = False
            rep.lines.append(f"✗ step {step} is damaged in the journal now ({made.left_out.damaged[step]}); run `verlj verify {run_dir}`")
        for step, problem in m.left_out.damaged.items():
            rep.lines.append(f"note: step {step} was left out of the export: it was damaged ({problem})")
    return rep


def _check_chain(rep: ExportReport, ledger: Ledger, spec: Spec, then: str | None) -> None:
    now: str | None
    try:
        now = ledger.journal.chain_hash(spec.last)
    except JournalError as e:
        now = None if then is None else f"unreadable ({e})"
    if then != now:
        rep.ok = False
        rep.lines.append(f"✗ the journal's chain at step {spec.last} is not the one exported from ({then}; now {now}): its steps were rewritten")
    elif now is None:
        rep.lines.append(f"note: the record of step {spec.last}, the last exported, could not be read when exported, nor now")
    else:
        rep.lines.append(f"✓ the journal holds steps {spec.first}–{spec.last} as exported (chain {now[:16]}…)")


def _check_files(rep: ExportReport, path: Path, files: list[FileEntry]) -> None:
    listed = {f.path for f in files}
    bad = 0
    for f in files:
        p = path / f.path
        if not p.is_file():
            rep.problem(f"{f.path}: missing", row=False)
        elif p.stat().st_size != f.bytes or file_digest(p) != f.blake3:
            rep.problem(f"{f.path}: its size or BLAKE3 digest differs from the manifest's (the file was changed)", row=False)
        else:
            continue
        bad += 1
    others = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in listed | {MANIFEST})
    for name in others:
        rep.problem(f"{name}: a file the manifest does not list", row=False)
    if bad or others:
        rep.lines.append(f"✗ {bad + len(others)} of the export's files are not as the manifest lists them")
    else:
        rep.lines.append(f"✓ {len(files)} files match the manifest (sizes and BLAKE3 digests)")


def _rows_of(path: Path, files: list[FileEntry], fmt: str) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of the data files, in order (where: 'row N of FILE', N from 1)."""
    for f in files:
        p = path / f.path
        if not p.is_file():
            continue
        try:
            for k, row in enumerate(file_rows(p, fmt), 1):
                yield f"row {k} of {f.path}", row
        except (OSError, ValueError) as e:
            raise RunError(f"{f.path} cannot be read as {fmt} ({e})") from None


def _check_rows(rep: ExportReport, made: Rows, rows: Iterator[tuple[str, dict]], ledger: Ledger) -> None:
    kind = made.spec.kind
    expected = ((row_key(kind, r), r) for sr in made.steps() for r in sr.rows)
    want = next(expected, None)
    last: tuple | None = None
    checked = 0
    for where, row in rows:
        rep.rows += 1
        try:
            key = row_key(kind, row)
        except (KeyError, TypeError):
            rep.problem(f"{where}: it has no lineage ({', '.join(KEYS[kind])})")
            continue
        if last is not None and key <= last:
            rep.problem(f"{where} ({_where(kind, key)}): {'twice' if key == last else 'out of order'}: an export's rows come in step order, "
                        f"then by sample, once each")
            continue
        last = key
        while want is not None and want[0] < key:
            rep.problem(f"{_where(kind, want[0])}: a row the export lacks (the journal holds it, and the filter makes it)")
            want = next(expected, None)
        if want is not None and want[0] == key:
            cols = differing(row, want[1])
            if cols:
                rep.problem(f"{where} ({_where(kind, key)}): {', '.join(cols)} differ{'s' if len(cols) == 1 else ''} from the journal")
            else:
                checked += 1
            want = next(expected, None)
        else:
            rep.problem(f"{where} ({_where(kind, key)}): {_unexpected(ledger, made, key)}")
    while want is not None:
        rep.problem(f"{_where(kind, want[0])}: a row the export lacks (the journal holds it, and the filter makes it)")
        want = next(expected, None)
    bad = rep.bad_rows
    if bad:
        rep.lines.append(f"✗ {bad} rows are not what the journal holds (of {rep.rows} read, {checked} checked)")
    else:
        what = "text, token ids and lineage" if made.spec.tokens else "text and lineage"
        rep.lines.append(f"✓ {checked} rows are what the journal holds ({what}), steps {made.spec.first}–{made.spec.last}")


def _unexpected(ledger: Ledger, made: Rows, key: tuple) -> str:
    """Why the journal makes no such row: the step is not exported, damaged or pruned; it holds no such sample;
    or the filter leaves it out."""
    step, spec = key[0], made.spec
    if not spec.first <= step <= spec.last:
        return f"step {step} is not among the exported steps {spec.first}–{spec.last}"
    if step in made.left_out.damaged:
        return f"step {step} is damaged in the journal ({made.left_out.damaged[step]}): its rows cannot be checked"
    try:
        record = ledger.journal.read_step(step)
    except JournalError as e:
        return f"step {step} cannot be read from the journal ({e})"
    if record.pruned:
        return f"step {step}'s samples were pruned from the journal: its rows cannot be checked"
    added = StepEvents.of(record).added
    ids = set(Columns(added.samples).ids.tolist()) if added is not None and added.samples is not None else set()
    missing = [sid for sid in key[1:] if sid not in ids]
    if missing:
        return f"step {step} holds no sample {missing[0]}"
    return "the export's filter does not make this row from the journal"


def render(rep: ExportReport) -> str:
    head = f"export {rep.path} ({rep.kind}) against run {rep.run}"
    shown = [f"  {p}" for p in rep.problems] + ([f"  ... and {rep.unshown} more"] if rep.unshown else [])
    end = ("OK: every row is what the run's journal holds" if rep.ok else
           "CHANGED: the export is not what the run's journal holds" + (" (each row named above)" if rep.problems else ""))
    return "\n".join([head, *rep.lines, *shown, end])


def to_json(rep: ExportReport) -> str:
    return json.dumps(rep.to_dict(), indent=2)
