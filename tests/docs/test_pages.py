"""The course site's pages: every Python block is executed by the build, and each Japanese
page runs exactly the code of its English page (only the prose is translated)."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

from attnlab.cli import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
TRANSLATED = ["index.md", "architecture.md", "glossary.md", "tutorials/index.md"]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of a Markdown text as (info string, dedented body), in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body, i = [], i + 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"unclosed {fence} fence opened as {lines[i - len(body) - 1]!r}")
        blocks.append((opening["info"].strip(), textwrap.dedent("\n".join(body))))
        i += 1
    return blocks


def english_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if not p.name.endswith(".ja.md"))


def test_code_blocks_parses_nested_and_indented_fences():
    text = "a\n```python exec=\"on\"\nx = 1\n```\n\n    ```bash\n    ls\n    ```\n"
    assert code_blocks(text) == [('python exec="on"', "x = 1"), ("bash", "ls")]
    with pytest.raises(ValueError, match="unclosed"):
        code_blocks("```python\nx = 1\n")


@pytest.mark.parametrize("page", english_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_block_is_executed(page: Path):
    for path in (page, page.with_suffix(".ja.md")):
        if not path.exists():
            continue
        for info, body in code_blocks(path.read_text(encoding="utf-8")):
            if info.split(" ")[0] in ("python", "py"):
                assert 'exec="on"' in info, (
                    f"{path.relative_to(DOCS)}: a python block that the build does not run "
                    f"(add exec=\"on\"): {body[:80]!r}"
                )


def tutorial_pages() -> list[Path]:
    return [p for p in english_pages() if p.parent.name == "tutorials" and p.name[:2].isdigit()]


def test_every_tutorial_and_page_has_a_japanese_version():
    missing = [
        str(p.relative_to(DOCS))
        for p in tutorial_pages() + [DOCS / name for name in TRANSLATED]
        if not p.with_suffix(".ja.md").exists()
    ]
    assert not missing, f"pages without a .ja.md translation: {missing}"
    assert len(tutorial_pages()) == 12


@pytest.mark.parametrize("page", tutorial_pages(), ids=lambda p: p.name)
def test_japanese_page_runs_the_same_code(page: Path):
    english = code_blocks(page.read_text(encoding="utf-8"))
    japanese = code_blocks(page.with_suffix(".ja.md").read_text(encoding="utf-8"))
    assert len(japanese) == len(english), (
        f"{page.name}: {len(english)} code blocks in English, {len(japanese)} in Japanese"
    )
    for n, (en, ja) in enumerate(zip(english, japanese)):
        assert en == ja, f"{page.name}: code block {n} differs between English and Japanese"


def shell_commands(body: str) -> list[list[str]]:
    """The command lines of a shell block: continuations joined, a quote left open carried
    into the next line, comments dropped, each split as the shell would (``shlex``)."""
    commands, pending = [], ""
    for line in body.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quotation still open: it goes on on the next line
            continue
        pending = ""
        if words:
            commands.append(words)
    if pending:
        raise ValueError(f"unclosed quotation in {pending!r}")
    return commands


def test_shell_commands_parses_continuations_and_comments():
    body = "attnlab demo --steps 2  # train\n# a comment\nattnlab viz \\\n    --text 'a # b'\n"
    assert shell_commands(body) == [["attnlab", "demo", "--steps", "2"],
                                    ["attnlab", "viz", "--text", "a # b"]]
    assert shell_commands("curl -d '{\n  \"a\": 1}'\nmake docs") == [
        ["curl", "-d", '{\n  "a": 1}'], ["make", "docs"]]
    with pytest.raises(ValueError, match="unclosed quotation"):
        shell_commands("echo 'a")


@pytest.mark.parametrize("page", english_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_command_line_on_a_page_is_one_the_cli_accepts(page: Path):
    """The shell blocks are not run (they name real checkpoints and full-size runs), but they
    cannot rot either: each ``attnlab`` line must parse with the real command line, each
    ``make`` target must exist."""
    parser = build_parser()
    targets = set(re.findall(r"^([a-z][\w-]*):", (DOCS.parent / "Makefile").read_text(), re.M))
    for path in (page, page.with_suffix(".ja.md")):
        if not path.exists():
            continue
        for info, body in code_blocks(path.read_text(encoding="utf-8")):
            if info.split(" ")[0] not in ("bash", "sh", "console"):
                continue
            for words in shell_commands(body):
                where = f"{path.relative_to(DOCS)}: {' '.join(words)!r}"
                if words[0] == "attnlab":
                    try:
                        parser.parse_args(words[1:])
                    except SystemExit as exit_:
                        pytest.fail(f"{where} is refused by attnlab's parser ({exit_})")
                elif words[0] == "make":
                    assert set(words[1:]) <= targets, f"{where}: no such make target"
