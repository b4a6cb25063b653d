"""The docs cannot drift: every file, test, module and name they point at exists.

Reference pages (README, ARCHITECTURE, the guide, reliability, package READMEs)
hold no line, module or test counts; history (counts at a point in time) lives
in CHANGELOG.md and in the dated reasoning of docs/decisions/. Each check names
the document and the statement that went stale.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = [
    ROOT / "README.md",
    ROOT / "docs" / "ARCHITECTURE.md",
    ROOT / "docs" / "writing-a-backend.md",
    ROOT / "docs" / "reliability.md",
    ROOT / "tests" / "README.md",
    *sorted(ROOT.glob("plugins/*/README.md")),
    ROOT / "core" / "README.md",
    ROOT / "kits" / "README.md",
    ROOT / "tools" / "README.md",
    ROOT / "examples" / "wt-example" / "README.md",
    ROOT / "integrations" / "trl" / "README.md",
]
DECISIONS = sorted((ROOT / "docs" / "decisions").glob("*.md"))
EVERY_DOC = [*REFERENCE, *DECISIONS, ROOT / "CHANGELOG.md", ROOT / "docs" / "bench.md"]

_SKIP_DIRS = {".git", ".nox", "build", "dist", "__pycache__", ".venv"}


def _files() -> dict[str, list[Path]]:
    """Every file of the repository by its name."""
    found: dict[str, list[Path]] = {}
    for path in ROOT.rglob("*"):
        if path.is_file() and not _SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
            found.setdefault(path.name, []).append(path)
    return found


FILES = _files()
_TICKED = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w./-]+\.(py|md|toml|json|yaml|yml|sh|txt|cfg)$")
_DOTTED = re.compile(r"^(weight_transfer|wt_[a-z_]+)(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_TEST_REF = re.compile(r"([\w/]*test_\w+\.py|weight_transfer[\w.]+)?::(test_\w+)")
CONFORMANCE = ROOT / "core" / "src" / "weight_transfer" / "testing" / "conformance.py"
# "N lines" and the like; a lines column; a file named with its size (`trainer.py` 176)
_COUNT = re.compile(
    r"\b\d[\d,]*\s+(lines|modules|tests|passed|test modules|names)\b|^\|.*\| lines \|"
    r"|`[\w/.-]+\.py` \d"
)
# Entry-point groups, named like modules.
GROUPS = {"weight_transfer.trainer", "weight_transfer.engine", "weight_transfer.hooks"}


def _docs(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.exists()]


def _ticked(doc: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        found += [(number, token) for token in _TICKED.findall(line)]
    return found


def _exists(token: str, doc: Path) -> bool:
    token = token.split("::")[0].rstrip("/")
    for base in (ROOT, doc.parent, ROOT / "core" / "src" / "weight_transfer"):
        if (base / token).exists():
            return True
    # a name given relative to the package it is listed under (`runtime/control.py`, `worker.py`)
    name = Path(token).name
    return any(str(p).endswith(token) for p in FILES.get(name, []))


@pytest.mark.parametrize("doc", _docs(EVERY_DOC), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    stale = [
        f"{doc.relative_to(ROOT)}:{n}: `{token}`"
        for n, token in _ticked(doc)
        if _PATH.match(token.split("::")[0]) and not _exists(token, doc)
    ]
    assert not stale, "files named in the docs that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", _docs(EVERY_DOC), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_doc_cites_exists(doc: Path) -> None:
    stale = []
    current: Path | None = None  # `::test_x` is in the file named last before it
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if "conformance suite (`::" in line:
            current = CONFORMANCE
        for file, test in _TEST_REF.findall(line):
            if file.startswith("weight_transfer"):
                current = ROOT / "core" / "src" / Path(*file.split(".")).with_suffix(".py")
            elif file:
                named = [p for p in FILES.get(Path(file).name, []) if str(p).endswith(file)]
                current = named[0] if len(named) == 1 else ROOT / file
            if current is None or not current.exists():
                stale.append(f"{doc.relative_to(ROOT)}:{number}: {file}::{test} (no such file)")
            elif not re.search(rf"^\s*(async )?def {test}\b", current.read_text(), re.M):
                stale.append(f"{doc.relative_to(ROOT)}:{number}: {test} is not in {current.name}")
    assert not stale, "tests cited in the docs that do not exist:\n" + "\n".join(stale)


_TEST_NAME = re.compile(r"^test_\w+$")


@pytest.mark.parametrize("doc", _docs(EVERY_DOC), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_doc_names_alone_exists(doc: Path) -> None:
    """A test named without its file (`test_x`) is defined somewhere in the tests."""
    defined = {
        name
        for path in [*(ROOT / "tests").rglob("test_*.py"), CONFORMANCE]
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M)
    }
    stale = [
        f"{doc.relative_to(ROOT)}:{n}: `{token}`"
        for n, token in _ticked(doc)
        if _TEST_NAME.match(token) and token not in defined
    ]
    assert not stale, "tests named in the docs that do not exist:\n" + "\n".join(stale)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


@pytest.mark.parametrize("doc", _docs(EVERY_DOC), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_a_doc_uses_resolves(doc: Path) -> None:
    stale = [
        f"{doc.relative_to(ROOT)}:{n}: `{token}`"
        for n, token in _ticked(doc)
        if _DOTTED.match(token) and token not in GROUPS and not _resolves(token)
    ]
    assert not stale, "modules or names in the docs that do not import:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", _docs(REFERENCE), ids=lambda p: str(p.relative_to(ROOT)))
def test_reference_pages_hold_no_counts(doc: Path) -> None:
    """Counts go stale with the next commit; history keeps them (CHANGELOG, decisions)."""
    stale = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if _COUNT.search(line)
    ]
    assert not stale, "counts in a reference page:\n" + "\n".join(stale)


def test_every_decision_cited_exists_and_superseded_ones_name_their_successor() -> None:
    headings: dict[int, str] = {}
    for doc in DECISIONS:
        for line in doc.read_text().splitlines():
            if line.startswith("#"):
                for number in re.findall(r"\(decisions? (\d+)", line):
                    headings[int(number)] = line
    cited = set()
    for doc in _docs(EVERY_DOC):
        text = doc.read_text()
        for span in re.findall(r"decisions? ((?:\d+(?:-\d+)?(?:, | and )?)+)", text):
            for part in re.findall(r"\d+(?:-\d+)?", span):
                low, _, high = part.partition("-")
                cited.update(range(int(low), int(high or low) + 1))
    missing = sorted(n for n in cited if n not in headings)
    assert not missing, f"decisions cited but not written: {missing}"
    for number, heading in headings.items():
        if "superseded" in heading.lower():
            successor = re.search(r"superseded[^)]*?decision (\d+)", heading, re.I)
            assert successor and int(successor.group(1)) in headings, (
                f"decision {number} is marked superseded without naming an existing successor"
            )


@pytest.mark.parametrize("doc", _docs(EVERY_DOC), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_speak_of_the_project_alone(doc: Path) -> None:
    """Readers have only this repository: no undefined "the spec"."""
    stale = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if re.search(r"\bthe spec\b|\bspec's\b|\bspec-style\b", line, re.I)
    ]
    assert not stale, "\n".join(stale)
