"""The README is a front page: its Python code blocks run as written, in order, in one
session (as a reader pasting them into one Python: a later example may use an earlier one's
names), it stays at most 250 lines, and every link in it resolves to a file of the repository
(and, for a link into a page, to one of that page's headings)."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.*?)(?: \{#([\w-]+)\})?\s*$", re.M)
SESSION: dict = {"__name__": "readme"}


def test_readme_has_examples():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    exec(compile(BLOCKS[index], f"README block {index}", "exec"), SESSION)


def test_readme_is_a_front_page_of_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move reference material into docs/"


def slug(title: str) -> str:
    """The anchor that Python-Markdown's ``toc`` (MkDocs) gives a heading: ASCII, lower case,
    punctuation dropped, spaces and hyphens run together into one hyphen."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings: an explicit ``{#id}`` or the title's slug."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {explicit or slug(title) for title, explicit in HEADING.findall(text)}


def test_slug_and_anchors_follow_the_toc_extension(tmp_path: Path):
    assert slug("How the project proves itself") == "how-the-project-proves-itself"
    assert slug("The command line: `attnlab generate`") == "the-command-line-attnlab-generate"
    page = tmp_path / "page.md"
    page.write_text("# A page\n## Set-up, and costs {#set-up}\n```sh\n# not a heading\n```\n")
    assert anchors(page) == {"a-page", "set-up"}


def test_every_link_in_the_readme_resolves_inside_the_repository():
    links = LINK.findall(README.read_text())
    assert links
    for link in links:
        assert not re.match(r"[a-z]+:", link), f"{link}: a link leaving the repository"
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        assert target.is_file() and ROOT in target.parents, f"{link}: no such file"
        if anchor:
            assert anchor in anchors(target), f"{link}: {path} has no heading #{anchor}"
