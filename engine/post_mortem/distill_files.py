"""The directory `verlj export RUN --sft/--dpo -o DIR` writes, and reading it back.

    DIR/data/train-00000-of-00001.parquet   the rows in order (--format jsonl: .jsonl); a new file past 256 MiB
    DIR/README.md                           a dataset card (`datasets.load_dataset(DIR)` finds data/train-* by itself)
    DIR/manifest.json                       the run's identity and config hash, the filter, the counts, the steps
                                            left out, and each file's size and BLAKE3 digest (a data file's rows too)
  --format arrow, for `datasets.load_from_disk(DIR)` (the layout `Dataset.save_to_disk` writes):
    DIR/data-00000-of-00001.arrow, DIR/dataset_info.json, DIR/state.json, DIR/README.md, DIR/manifest.json

Rows are streamed to the files (a row group each 1,024 rows), so memory stays flat whatever the run's length.
The directory is written beside DIR under a temporary name and renamed into place at the end: a failed export
leaves DIR as it was. An existing DIR is replaced only when it is empty or an export itself (its manifest.json).
pyarrow is needed for Parquet and Arrow (``pip install 'verlj[archive]'``); JSONL needs nothing more.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from verlj.journal import JournalError

from ..errors import RunError, UsageError
from ..loop.ledger import now_iso, open_run
from ..schema.record import Record
from ..state.manifest import file_digest
from .distill import DPO, Counts, Form, LeftOut, Rows, Spec
from .outputs import check_output, make_parent, remove_made
from .steps import parse_steps
from .views import _view

if TYPE_CHECKING:
    from ..loop.ledger import Ledger

FORMATS = ("parquet", "jsonl", "arrow")
MANIFEST, CARD = "manifest.json", "README.md"
MARK = "verlj_export"  # the manifest's key that says the directory is an export, and of which version
VERSION = 1
BATCH_ROWS = 1024  # rows a write (a Parquet row group, an Arrow record batch)
FILE_BYTES = 256 << 20  # a data file is closed past this, and the next begun
_EXT = {"parquet": "parquet", "jsonl": "jsonl", "arrow": "arrow"}


# ----------------------------------------------------------------------------- writing

class Sink:
    """The rows, written in order into data files of one format, each closed past FILE_BYTES."""

    def __init__(self, root: Path, fmt: str, schema, columns: list[str]):
        self.root, self.fmt, self.schema, self.columns = root, fmt, schema, columns
        self.parts: list[tuple[Path, int]] = []  # (file, rows), in order
        self._w: Any = None
        self._f: Any = None
        self._rows = 0

    def _open(self) -> None:
        path = self.root / f"part-{len(self.parts):05d}.{_EXT[self.fmt]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._rows = 0
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            self._w = pq.ParquetWriter(path, self.schema, compression="zstd")
        elif self.fmt == "arrow":
            import pyarrow as pa

            self._f = open(path, "wb")
            self._w = pa.ipc.new_stream(self._f, self.schema)
        else:
            self._f = open(path, "w", encoding="utf-8")
        self.parts.append((path, 0))

    def write(self, rows: list[dict]) -> None:
        if self._w is None and self._f is None:
            self._open()
        if rows and self.fmt == "jsonl":
            self._f.write("".join(json.dumps(r, ensure_ascii=False, allow_nan=True) + "\n" for r in rows))
        elif rows:
            import pyarrow as pa

            self._w.write_table(pa.Table.from_pylist(rows, self.schema))
        self._rows += len(rows)
        self.parts[-1] = (self.parts[-1][0], self._rows)
        if self._size() >= FILE_BYTES:
            self._close()

    def _size(self) -> int:
        return self._f.tell() if self._f is not None else self.parts[-1][0].stat().st_size

    def _close(self) -> None:
        if self._w is not None:
            self._w.close()
        if self._f is not None:
            self._f.close()
        self._w = self._f = None

    def close(self) -> list[tuple[Path, int]]:
        if not self.parts:
            self.write([])  # one file, even empty: it carries the schema
        self._close()
        return self.parts


def _data_names(fmt: str, n: int) -> list[str]:
    if fmt == "arrow":
        return [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
    return [f"data/train-{i:05d}-of-{n:05d}.{_EXT[fmt]}" for i in range(n)]


@dataclass(frozen=True)
class Written:
    """What an export wrote: rows, the data files (relative to DIR), notes for the user."""

    rows: int
    files: list[str]
    notes: list[str]


@dataclass(frozen=True)
class Recorded:
    """What the run's identity (Ledger.identity) says of it that an export names."""

    created: str | None = None
    config_hash: str | None = None
    seed: int | None = None
    git_commit: str | None = None


@dataclass(frozen=True)
class RunIdentity(Record):
    """The run an export came from (the manifest's ``run``): its directory's name and path then, when it was made,
    its config hash, seed and commit, where its journal starts (a fork's base step, its parent; a what-if's
    counterfactual), and the chain hash of the last exported step's record (the journal as it was read)."""

    name: str
    path: str
    created: str | None
    config_hash: str | None
    seed: int | None
    git_commit: str | None
    base_step: int
    parent: dict[str, Any] | None  # loop.records.ParentRun's map, as the run stored it
    whatif: dict[str, Any] | None  # loop.records.Counterfactual's map, as the run stored it
    last_step_chain: str | None


@dataclass(frozen=True)
class FileEntry(Record):
    """A file of the export: its path in DIR, its size, its BLAKE3 digest, and a data file's rows (None: no data)."""

    path: str
    bytes: int
    blake3: str
    rows: int | None = None


@dataclass(frozen=True)
class Manifest(Record):
    """DIR/manifest.json."""

    verlj_export: int  # the format's version (MARK)
    kind: str
    format: str
    run: RunIdentity
    filter: Spec
    form: Form
    columns: list[str]
    rows: int
    counts: Counts
    left_out: LeftOut
    written: str
    verlj: str
    files: list[FileEntry]

    @property
    def data(self) -> list[FileEntry]:
        return [f for f in self.files if f.rows is not None]


def export_dataset(run_dir: Path, out: Path, kind: str, fmt: str, steps: str | None, **filters: Any) -> Written:
    """Write the `kind` rows (sft | dpo) of `run_dir`'s steps A:B to the directory `out` (:mod:`.distill`'s
    rows; `filters`: Spec's fields), with its manifest and card. Refuses a filter that selects no row."""
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "jsonl":
        from ..schema.table import require_pyarrow

        require_pyarrow(f"--format {fmt}", UsageError)
    Spec(kind, 1, 1, **filters)  # the filter's own sentence, before the output or the run is looked at
    _check_output(out)
    a, b = parse_steps(steps)
    run_dir = Path(run_dir)
    with open_run(run_dir) as ledger:
        first, last = ledger.base_step() + 1, ledger.last_step()
        a, b = max(a or first, first), min(b or last, last)
        if a > b:
            raise UsageError(f"--steps selects no step: this run has steps {first}–{last}") if last >= first else RunError("this run has no step yet")
        spec = Spec(kind, a, b, **filters)
        made = Rows(ledger, run_dir.resolve().name, spec)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        folders = make_parent(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        published = False
        try:
            files = _write_rows(tmp, fmt, made)
            if made.counts.rows == 0:
                raise RunError(f"nothing to write: {_counted(made)}")
            identity = run_identity(ledger, run_dir, spec)
            if fmt == "arrow":
                _write_disk_layout(tmp, files, identity)
            manifest = Manifest(VERSION, kind, fmt, identity, spec, made.form, made.form.columns(spec), made.counts.rows, made.counts,
                                made.left_out, now_iso(), version("verlj"), files)
            (tmp / CARD).write_text(card(manifest))
            names = {f.path for f in files}
            extra = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and str(p.relative_to(tmp)) not in names)
            manifest = replace(manifest, files=files + [FileEntry(name, (tmp / name).stat().st_size, file_digest(tmp / name)) for name in extra])
            (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False) + "\n")
            _publish(tmp, out)
            published = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if not published:
                remove_made(folders)
    return Written(made.counts.rows, sorted(names), made.left_out.notes(run_dir))


def _write_rows(tmp: Path, fmt: str, made: Rows) -> list[FileEntry]:
    """Stream the rows into data files under `tmp`, named as their format's layout has them."""
    sink = Sink(tmp, fmt, _schema(fmt, made.spec, made.form), made.form.columns(made.spec))
    batch: list[dict] = []
    for got in made.steps():
        batch += got.rows
        if len(batch) >= BATCH_ROWS:
            sink.write(batch)
            batch = []
    sink.write(batch)
    parts = sink.close()
    files = []
    for (path, rows), name in zip(parts, _data_names(fmt, len(parts))):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, tmp / name)
        files.append(FileEntry(name, (tmp / name).stat().st_size, file_digest(tmp / name), rows))
    return files


def _counted(made: Rows) -> str:
    c, spec = made.counts, made.spec
    said = [f"{c.samples} samples read"]
    for n, what in ((c.faults, "ended by a fault"), (c.empty, "with no token of the policy's"), (c.below_min_score, f"below --min-score {spec.min_score}")):
        if n:
            said.append(f"{n} {what}")
    if spec.kind == DPO and c.no_pair:
        said.append(f"{c.no_pair} groups' prompts without two samples whose scores differ" + (f" by --margin {spec.margin} or more" if spec.margin else ""))
    if c.duplicates:
        said.append(f"{c.duplicates} duplicates")
    return "; ".join(said) + f", over steps {spec.first}–{spec.last}"


def _schema(fmt: str, spec: Spec, form: Form):
    if fmt == "jsonl":
        return None
    from .distill import arrow_schema

    return arrow_schema(spec, form)


def run_identity(ledger: Ledger, run_dir: Path, spec: Spec) -> RunIdentity:
    """What names the run an export came from: the manifest's ``run``, what verify checks a run against."""
    rec = _view(Recorded, ledger.identity.all())
    try:
        chain = ledger.journal.chain_hash(spec.last)
    except JournalError:  # its frame unreadable: the step was left out, and said
        chain = None
    return RunIdentity(run_dir.resolve().name, str(run_dir.resolve()), rec.created, rec.config_hash, rec.seed, rec.git_commit,
                       ledger.base_step(), ledger.identity.parent(), ledger.identity.counterfactual(), chain)


def _check_output(out: Path) -> None:
    check_output("--output", out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {out} is a file; an SFT or DPO export is a directory: name one")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise UsageError(f"--output {out} holds files and is not an export of `verlj export --sft/--dpo` (no export "
                         f"{MANIFEST}); name a new or empty directory")


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory into place (the old export, if any, aside first, then removed)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_disk_layout(tmp: Path, files: list[FileEntry], identity: RunIdentity) -> None:
    """dataset_info.json and state.json as `Dataset.save_to_disk` writes them (the features: from the files' schema)."""
    fingerprint = blake3.blake3(json.dumps([identity.to_dict(), [f.path for f in files]]).encode()).hexdigest()[:16]
    (tmp / "dataset_info.json").write_text(json.dumps({"description": f"rows exported by verlj from run {identity.name}"}, indent=2))
    (tmp / "state.json").write_text(json.dumps({"_data_files": [{"filename": f.path} for f in files], "_fingerprint": fingerprint,
                                                "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                                                "_output_all_columns": False, "_split": "train"}, indent=2))


def card(m: Manifest) -> str:
    """The dataset card (README.md): what the rows are, where they came from, how to load and check them."""
    run, spec = m.run, m.filter
    # no `configs` in the card: `load_dataset(DIR)` finds data/train-* by itself, and a card's configs key the cache by
    # the directory's name, not the files (datasets 5.2: two exports named alike would load as one)
    head = f"---\ntags:\n- verlj\n- {m.kind}\n---\n\n"
    load = ('from datasets import load_from_disk\nds = load_from_disk("DIR")' if m.format == "arrow" else
            f'from datasets import load_dataset\nds = load_dataset("{"parquet" if m.format == "parquet" else "json"}", '
            'data_files="DIR/data/train-*", split="train")')
    chosen = {k: v for k, v in spec.to_dict().items() if k not in ("kind", "first", "last") and v not in (None, False, 0.0)}
    lines = [f"# {m.kind.upper()} rows of the verlj run `{run.name}`", "",
             f"{m.rows} rows ({'preference pairs' if m.kind == DPO else 'one per sample'}) from steps {spec.first}–{spec.last} "
             f"of the run made {run.created} (config hash `{run.config_hash}`), written {m.written} by verlj {m.verlj}; "
             f"filter: {', '.join(f'{k}={v}' for k, v in chosen.items()) or 'none'}.", "",
             f"Columns: {', '.join(f'`{c}`' for c in m.columns)}.", "",
             "Each row carries its lineage: the run, the step, the sample (and the policy version that generated it), its score, and "
             "`chain`, the hash of the step's record in the run's hash-chained journal. `manifest.json` has each file's BLAKE3 digest. "
             "Check every row against the run's journal (text and token ids):", "", "```bash", "verlj verify DIR --against RUN", "```", "",
             "Load it:", "", "```python", load, "```"]
    if m.left_out.damaged or m.left_out.pruned:
        lines += ["", f"Steps left out: damaged {sorted(m.left_out.damaged) or 'none'}, pruned {m.left_out.pruned or 'none'}."]
    return head + "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- reading back

def is_export(path: Path) -> bool:
    """Whether DIR holds an export's manifest."""
    try:
        d = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and MARK in d


def read_manifest(path: Path) -> Manifest:
    """DIR's manifest, or RunError saying why DIR is not an export this verlj reads."""
    f = Path(path) / MANIFEST
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{path} is not an export of `verlj export --sft/--dpo`: {MANIFEST} " +
                       ("is missing" if isinstance(e, OSError) else f"does not parse ({e})")) from None
    if not isinstance(d, dict) or MARK not in d:
        raise RunError(f"{f} is not the manifest of a verlj export (no {MARK!r} key)")
    if d[MARK] != VERSION:
        raise RunError(f"{f} is an export of version {d[MARK]}; this verlj reads version {VERSION}")
    try:
        return Manifest.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError, RunError) as e:
        raise RunError(f"{f} is not a complete export manifest ({e})") from None


def file_rows(path: Path, fmt: str) -> Iterator[dict]:
    """The rows of one data file, in order, as Python values (streamed: a batch at a time)."""
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for i in range(pf.num_row_groups):  # a row group at a time (iter_batches reads ahead: its memory grows with the file)
            yield from pf.read_row_group(i).to_pylist()
    else:
        import pyarrow as pa

        with open(path, "rb") as raw, pa.ipc.open_stream(raw) as reader:
            for batch in reader:
                yield from batch.to_pylist()
