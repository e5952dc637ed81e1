"""The suite collects: tests/ has no __init__.py files, so pytest imports each test module by its
basename, and two test files of one name in different folders stop the whole collection
("import file mismatch"), which no targeted run of either file shows."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


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
