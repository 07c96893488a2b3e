"""Every relative link in README.md, benchmarks/README.md and the pages under docs/ (the results pages and
their artefacts included) resolves: the file or folder exists, and a `#anchor` names a heading of the page it
points into, slugged as GitHub slugs headings. So a page can move or a heading be renamed without links
rotting silently. External links (http, https, mailto) are not fetched."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]*(?:\([^()\s]*\)[^()\s>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", lambda m: "`" * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation other than - and _ dropped, spaces -> -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the headings of `page` (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        found = None if fenced else HEADING.match(line)
        if found:
            base = slug(found.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image in `page`'s prose."""
    return [(number, m.group(1)) for number, line in prose_lines(page.read_text(encoding="utf-8"))
            for m in LINK.finditer(line)]


def broken(page: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        into = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{number}: ({target})"
        if not into.exists():
            problems.append(f"{where} points to {path}, which does not exist")
        elif anchor and into.is_dir():
            problems.append(f"{where} has an anchor into a folder")
        elif anchor and into.suffix == ".md" and anchor not in anchors(into):
            problems.append(f"{where}: {into.relative_to(REPO)} has no heading whose anchor is #{anchor}")
    return problems


def test_the_slug_is_githubs():
    assert slug("Conversion with aligned and fitted heads (`--method aligned` / `fit`, no uptraining)") == \
        "conversion-with-aligned-and-fitted-heads---method-aligned--fit-no-uptraining"
    assert slug("The GQA paper's experiment on T5") == "the-gqa-papers-experiment-on-t5"
    assert slug("`--method transfer`") == "--method-transfer"
    assert slug("Calibration text and `gqakit sample`") == "calibration-text-and-gqakit-sample"


def test_links_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A b\n\n[x](other.md#a-b) and ![y](img/p.png \"t\") `[no](code.md)`\n\n"
                    "```\n[no](fenced.md)\n```\n## A b\n[z](#a-b-1)\n")
    assert [t for _, t in links(page)] == ["other.md#a-b", "img/p.png", "#a-b-1"]
    assert anchors(page) == {"a-b", "a-b-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    problems = broken(page)
    assert not problems, "broken links (fix the link, or the heading it names):\n  " + "\n  ".join(problems)
