"""The README's code tour and the docs' links stay true: each toured file exists and defines what the
tour says it defines, and every relative link (and its #anchor) in README.md and docs/ finds its target."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").rglob("*.md")])

_TOUR_LINE = re.compile(r"^- `(?P<path>[^`]+)` — (?P<names>`[^:]+`):")
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tour() -> list[tuple[str, list[str]]]:
    """(path, names) for each line of the README's code tour."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Code tour\n", 1)[1].split("\n## ", 1)[0]
    return [(m["path"], re.findall(r"`([A-Za-z_]\w*)`", m["names"]))
            for m in map(_TOUR_LINE.match, section.splitlines()) if m]


def test_the_readme_has_a_code_tour_of_five_to_eight_files():
    entries = tour()
    assert 5 <= len(entries) <= 8, entries
    assert all(names for _, names in entries), entries


@pytest.mark.parametrize(("path", "names"), tour(), ids=[p for p, _ in tour()])
def test_each_toured_file_defines_what_the_tour_names(path, names):
    file = REPO / path
    assert file.is_file(), f"README's code tour names {path}, which does not exist"
    tree = ast.parse(file.read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    missing = [name for name in names if name not in defined]
    assert not missing, f"README's code tour says {path} defines {missing}; it defines no such function or class"


def github_anchor(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens, and
    -1, -2, ... after repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    return {github_anchor(m[1], seen) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [m["target"] for m in _LINK.finditer(text) if not re.match(r"[a-z][a-z0-9+.-]*:", m["target"])]


def test_the_link_check_reads_links_and_anchors_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Exit codes\n## A warm trainer (`scaling.keep_warm_s`)\n## Exit codes\n"
                    "[a](other.md#x) ![b](img/c.png) [web](https://example.com) `[not](a-link.md)`\n"
                    "```\n[not](either.md)\n```\n", encoding="utf-8")
    assert anchors(page) == {"exit-codes", "a-warm-trainer-scalingkeep_warm_s", "exit-codes-1"}
    assert relative_links(page) == ["other.md#x", "img/c.png"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_relative_link_points_at_an_existing_file_and_heading(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)
