"""Every relative link in the user docs (README.md, docs/**/*.md) names a file that exists.

A link is resolved as a Markdown renderer does: relative to the file that holds it, so
`[x](docs/a.md)` written inside docs/ points at docs/docs/a.md and is caught. URLs and
in-page anchors are not checked; links inside code (fenced blocks, `inline`) are not links.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def doc_files(root: Path) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def relative_links(text: str) -> Iterator[tuple[int, str]]:
    """(line, target) of each relative link outside code, its #anchor removed."""
    blank = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)
    blank = _INLINE_CODE.sub(lambda m: " " * len(m[0]), blank)
    for m in _LINK.finditer(blank):
        target = m[1].split("#", 1)[0]
        if target and not _SCHEME.match(target):
            yield blank.count("\n", 0, m.start()) + 1, target


def broken_links(root: Path) -> list[str]:
    """'file:line: target' for every relative link whose file does not exist."""
    broken = []
    for path in doc_files(root):
        for line, target in relative_links(path.read_text()):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(root)}:{line}: {target}")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    assert broken_links(REPO) == []


def test_a_link_written_from_the_wrong_directory_is_caught(tmp_path: Path) -> None:
    """Positive control: the mistake this test exists for, in a tree of its own."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "workers.md").write_text("# Workers\n")
    (tmp_path / "README.md").write_text("[workers](docs/workers.md), [up](#top)\n")
    (tmp_path / "docs" / "config.md").write_text(
        "fine: [w](workers.md#pool) and [r](../README.md), [web](https://example.com/x)\n"
        "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "broken: [w](docs/workers.md)\n"
    )
    assert broken_links(tmp_path) == ["docs/config.md:6: docs/workers.md"]
