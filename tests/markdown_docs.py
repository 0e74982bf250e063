"""The project's Markdown documentation as the tests read it: README.md and every page under docs/.

A fenced block tagged ```python is an example a user pastes into a new interpreter, so the tests run
it. A block that cannot run in the tests (it needs a running server, a cluster or a file the
repository lacks) is tagged ```text or ```bash instead, and is only read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*```(.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title"; the text may wrap onto the next line.
_LINK = re.compile(r"!?\[[^\[\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documentation_files(root: Path = ROOT) -> list[Path]:
    """README.md, then every Markdown page under docs/, in path order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Snippet:
    """One ```python block: where it is and what it runs."""

    path: Path
    line: int
    heading: str
    code: str


@dataclass(frozen=True)
class Link:
    """One relative link in a page's prose: the line it is on and its target as written."""

    path: Path
    line: int
    target: str


def _prose_and_blocks(text: str) -> tuple[list[str], list[tuple[int, str, str]]]:
    """The page's lines with fenced blocks blanked out, and its blocks as ``(first line, tag, code)``."""
    prose: list[str] = []
    blocks: list[tuple[int, str, str]] = []
    open_tag: str | None = None
    start, body = 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if open_tag is None and fence:
            open_tag, start, body = fence.group(1).strip(), number, []
            prose.append("")
        elif open_tag is not None and fence and not fence.group(1).strip():
            blocks.append((start, open_tag, "".join(body)))
            open_tag = None
            prose.append("")
        elif open_tag is not None:
            body.append(line + "\n")
            prose.append("")
        else:
            prose.append(line)
    if open_tag is not None:
        raise ValueError(f"a ```{open_tag} block opened on line {start} is never closed")
    return prose, blocks


def python_snippets(path: Path) -> list[Snippet]:
    """Every ```python block of ``path``, each with the heading it sits under."""
    prose, blocks = _prose_and_blocks(path.read_text(encoding="utf-8"))
    snippets = []
    for start, tag, code in blocks:
        if tag != "python":
            continue
        headings = [m.group(2) for line in prose[: start - 1] if (m := _HEADING.match(line))]
        snippets.append(Snippet(path, start, headings[-1] if headings else "top", code))
    return snippets


def github_anchor(heading: str) -> str:
    """The ``#fragment`` a forge gives a heading: its text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading reads as its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The fragments ``path``'s headings can be linked by (a repeated heading gets ``-1``, ``-2``, ...)."""
    prose, _ = _prose_and_blocks(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        if match := _HEADING.match(line):
            slug = github_anchor(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[Link]:
    """Every link of ``path``'s prose (outside code) that points into the repository, not to a URL."""
    prose, _ = _prose_and_blocks(path.read_text(encoding="utf-8"))
    text = "\n".join(_INLINE_CODE.sub("", line) for line in prose)
    links = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if _SCHEME.match(target):
            continue
        links.append(Link(path, text.count("\n", 0, match.start()) + 1, target))
    return links


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """``file:line: target`` for each relative link whose file, or heading, does not exist."""
    broken = []
    for page in pages:
        for link in relative_links(page):
            file_part, _, fragment = link.target.partition("#")
            if file_part.startswith("/"):
                target = root / file_part.lstrip("/")
            else:
                target = (page.parent / file_part) if file_part else page
            where = f"{page.relative_to(root)}:{link.line}: {link.target}"
            if not target.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{where} (no heading #{fragment} in {target.name})")
    return broken
