"""Relative links in README.md and docs/ lead somewhere, and docs/index.md lists every page.

A page moved or renamed leaves links to it that render fine and lead nowhere; these tests fail on them.
"""

from __future__ import annotations

from pathlib import Path

from tests.markdown_docs import ROOT, broken_links, documentation_files, python_snippets, relative_links


def test_every_relative_link_in_the_readme_and_docs_points_to_an_existing_file_and_heading():
    pages = documentation_files()
    assert len(pages) > 10, f"found only {[str(p.relative_to(ROOT)) for p in pages]}: docs/ went missing"
    assert sum(len(relative_links(page)) for page in pages) > 20, "the link pattern found almost no links"
    broken = broken_links(pages)
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_check_reports_a_missing_file_and_a_missing_heading_and_ignores_code(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# Here\n\n## Two words\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n"
        "[ok](docs/here.md) [ok too](docs/here.md#two-words) [self](#top) [web](https://example.org/x.md)\n"
        "[gone](docs/gone.md) and a link that\nwraps [no heading](docs/here.md#three)\n"
        "`[inline code](docs/absent.md)`\n\n"
        "```text\n[in a block](docs/absent.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links([page], root=tmp_path) == [
        "README.md:4: docs/gone.md (no such file)",
        "README.md:5: docs/here.md#three (no heading #three in here.md)",
    ]


def test_the_docs_index_links_every_page_under_docs():
    index = ROOT / "docs" / "index.md"
    listed = {(index.parent / link.target.partition("#")[0]).resolve() for link in relative_links(index)}
    pages = {page.resolve() for page in documentation_files()[1:]} - {index.resolve()}
    missing = sorted(str(page.relative_to(ROOT)) for page in pages - listed)
    assert not missing, f"docs/index.md does not list {missing}"
    readme_targets = {link.target for link in relative_links(ROOT / "README.md")}
    assert "docs/index.md" in readme_targets, "the README does not link the docs index"


def test_python_blocks_are_found_with_the_heading_they_sit_under(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\n# not a heading\n```\n\n## Section\n\n```python\nprint(1)\n```\n\n"
        "```text\nprint(2)\n```\n",
        encoding="utf-8",
    )
    [snippet] = python_snippets(page)
    assert (snippet.line, snippet.heading, snippet.code) == (9, "Section", "print(1)\n")
