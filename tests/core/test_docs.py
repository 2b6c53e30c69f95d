"""README and docs/ name only tests and files that exist.

The documentation cites tests as its evidence ("`test_reliability.py::test_…`", "`tests/core/test_ring.py`"). A
cited test that was renamed or never written turns a claim into an unbacked one, silently; so every test file and
test function named in README.md and docs/ (raw benchmark output aside: it is a record, not a claim) must exist,
and every relative link must lead to a file of the repository.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Raw benchmark output is kept as it came back; it is not documentation.
RAW = REPO / "docs" / "bench" / "raw"
TEST_FILE = re.compile(r"\b(test_[a-z0-9_]+)\.py\b")
#: A function is cited after ``::`` or alone in backticks.
TEST_FUNCTION = re.compile(r"(?:::|`)(test_[a-z0-9_]+)\b(?!\.py)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def documents() -> list[Path]:
    """README.md and every markdown page under docs/ but the raw benchmark output."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [page for page in pages if RAW not in page.parents]


@cache
def modules_of_tests() -> dict[Path, str]:
    """Every test module of the repository, with its text (two tiers may hold modules of the same name)."""
    return {path: path.read_text() for path in (REPO / "tests").rglob("test_*.py")}


def defined_tests() -> set[str]:
    """The names of every test function defined in the repository's tests."""
    names: set[str] = set()
    for text in modules_of_tests().values():
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_[a-z0-9_]+)\(", text, re.MULTILINE))
    return names


def test_every_test_file_the_docs_name_exists() -> None:
    missing = [
        f"{page.relative_to(REPO)}: {name}.py"
        for page in documents()
        for name in sorted(set(TEST_FILE.findall(page.read_text())))
        if f"{name}.py" not in {path.name for path in modules_of_tests()}
    ]
    assert not missing, "the documentation names test files that do not exist:\n" + "\n".join(missing)


def test_every_test_function_the_docs_name_exists() -> None:
    defined = defined_tests()
    missing = [
        f"{page.relative_to(REPO)}: {name}"
        for page in documents()
        for name in sorted(set(TEST_FUNCTION.findall(page.read_text())))
        if name not in defined
    ]
    assert not missing, "the documentation names tests that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_in_the_docs_leads_to_a_file() -> None:
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in documents()
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_readme_stays_short_enough_to_read() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move details to docs/ (it is read top to bottom)"
