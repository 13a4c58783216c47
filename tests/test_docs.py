"""The documents keep their promises: every number in the README's results comes from docs/RESULTS.md, which
cites only results files that exist, and every results file is cited (one name per experiment, no orphans)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "experiments" / "results"
RESULTS_MD = (ROOT / "docs" / "RESULTS.md").read_text()
CITED = re.compile(r"(?:experiments/results/)?\b([a-z][a-z0-9_.]*)\.(md|json|png)\b")
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def cited_results(text: str) -> set[str]:
    """Results file names (``name.ext``) a text cites by path or by a bare name that a results file has."""
    names = {f"{stem}.{ext}" for stem, ext in CITED.findall(text)}
    return {n for n in names if "experiments/results/" + n in text or (RESULTS_DIR / n).exists()
            or n.split(".")[0] in {p.stem for p in RESULTS_DIR.iterdir()}}


def test_every_results_file_a_document_or_comment_cites_exists() -> None:
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "tfmem").rglob("*.py"),
               *(ROOT / "passes").glob("*.py")]
    missing = sorted(f"{p.relative_to(ROOT)}: experiments/results/{name}" for p in sources
                     for name in re.findall(r"experiments/results/([\w.]+\.(?:md|json|png))", p.read_text())
                     if not (RESULTS_DIR / name).exists())
    assert missing == []


def test_every_results_file_is_cited_by_results_md() -> None:
    stems = {n.split(".")[0] for n in cited_results(RESULTS_MD)}
    orphans = sorted(p.name for p in RESULTS_DIR.iterdir() if p.name.split(".")[0] not in stems)
    assert orphans == []


def readme_results_numbers() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    return {n for n in NUMBER.findall(section) if len(n.replace(",", "").replace(".", "")) > 1 or "." in n}


def test_every_number_in_the_readme_results_is_in_results_md() -> None:
    numbers = readme_results_numbers()
    assert len(numbers) > 20   # the section has its tables
    assert sorted(n for n in numbers if n not in RESULTS_MD) == []
