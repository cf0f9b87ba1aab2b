"""Runs the Python blocks of a course page the way the docs build does, without building the
site: ``python tests/docs/page_runner.py docs/tutorials/01-attention.md`` prints each block's
output and exits with status 1 at the first block that raises (a failed ``assert`` check).

markdown-exec, which runs the blocks during ``make docs``, gives the blocks of one ``session``
the same globals and every other block empty ones; a block that raises is a warning, and
``mkdocs build --strict`` fails on it. The runner does the same, so one page can be checked in
seconds instead of building the whole site.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import textwrap
import traceback
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
OPTION = re.compile(r'(\w+)="([^"]*)"')


class BlockError(Exception):
    """A block of a page raised; the message names the page, the block and its traceback."""


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


def executed_blocks(text: str) -> list[tuple[dict[str, str], str]]:
    """The Python blocks that the build runs (``exec="on"``) as (options, code), in order."""
    return [
        (dict(OPTION.findall(info)), body)
        for info, body in code_blocks(text)
        if info.split(" ")[0] in ("python", "py") and 'exec="on"' in info
    ]


def run_page(path: Path, echo: bool = False) -> list[str]:
    """Run the executed blocks of the page at ``path``; return what each printed.

    Raises ``BlockError`` at the first block that raises, with its traceback.
    """
    sessions: dict[str, dict] = {}
    outputs = []
    for n, (options, code) in enumerate(executed_blocks(path.read_text(encoding="utf-8"))):
        session = options.get("session")
        scope = sessions.setdefault(session, {}) if session else {}
        scope.setdefault("__name__", f"page_block_{n}")
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, f"<{path.name}: block {n}>", "exec"), scope)
        except Exception as error:
            raise BlockError(
                f"{path}: block {n} (session {session}) failed:\n{traceback.format_exc()}"
                f"printed before it failed:\n{buffer.getvalue()}"
            ) from error
        outputs.append(buffer.getvalue())
        if echo:
            print(f"--- block {n} ({session})\n{buffer.getvalue()}", end="", flush=True)
    return outputs


def main(argv: list[str]) -> int:
    for name in argv:
        try:
            run_page(Path(name), echo=True)
        except BlockError as failure:
            print(failure, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
