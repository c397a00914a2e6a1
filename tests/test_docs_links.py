"""Every relative link in README.md and docs/ points at a file in the repo (and a heading there).

Why: the docs are read on a checkout or on the forge, where a link to a file outside the
repo (a design note in a sibling folder) or to a heading that was renamed is a dead end,
and nothing else notices: pages move (docs/benchmarks.md became docs/benchmarks/) and
anchors are GitHub's slugs of headings, which change with the heading's words.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: ``[text](target)`` and ``![alt](target)``; the target ends at whitespace or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1, with inline code blanked."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, INLINE_CODE.sub("``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 for repeats."""
    counts: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """This file's relative links that name no file under ``root``, or no heading there."""
    broken: list[str] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not linked.is_relative_to(root) or not linked.exists():
                broken.append(f"{where} (no such file in the repo)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    """A relative link names a file of the repo and, with ``#anchor``, one of its headings."""
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    """The check itself: a missing file, a file outside the root and a bad anchor all fail."""
    (tmp_path / "outside.md").write_text("# Outside\n", encoding="utf-8")
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "there.md").write_text("# There\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page = root / "docs" / "page.md"
    page.write_text(
        "[a](missing.md) [b](../../outside.md) [c](#nowhere) [d](#here) [e](there.md#twice-1)\n"
        "[f](there.md#there) `[g](not-a-link.md)`\n\n```\n[h](in-a-fence.md)\n```\n\n# Here\n",
        encoding="utf-8",
    )
    found = broken_links(page, root)
    assert len(found) == 3, found
    assert "missing.md" in found[0] and "outside.md" in found[1] and "#nowhere" in found[2]
