"""A cache for the Python blocks that markdown-exec runs while the site builds.

Every ``exec="on"`` block of a page runs at build time, which takes minutes. A page's blocks
are replayed from the cache, without running, when the cache holds an entry for the same
key: a SHA-256 of

- the page's executed blocks, each with its options, in order, with their comments set aside
  (the blocks of a session share their globals, so one changed block re-runs the whole page;
  a changed comment changes nothing that runs), and
- the library they import: every file of the ``attnlab`` package that Python imports
  (``src/attnlab`` in a checkout) and of the repository's ``devbench/``, with its path, plus
  the Python and torch versions, and
- the files of the repository's ``benchmarks/`` whose names the page's blocks mention (a block
  that prints a committed table runs again when the table changes).

So ``make docs`` re-runs a page only when its code, the library or a table it reads changed;
a Japanese page, whose code is its English twin's with the comments translated, replays the
English page's outputs (one whose figure labels are translated runs on its own). An entry is written
only when every block of the page ran without raising: a failed check is never cached, and
fails every build until it is fixed. Entries are JSON files (the printed text of each block)
under ``$ATTNLAB_DOCS_CACHE``, by default ``.cache/docs-exec`` beside ``mkdocs.yml``;
deleting the folder runs everything again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import tokenize
from pathlib import Path

import torch
from markdown_exec._internal.formatters import python as exec_python

import attnlab

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
log = logging.getLogger("mkdocs.hooks.exec_cache")
# A second load of this hook (a rebuild) wraps markdown-exec's own runner, not the first wrapper.
_original_run = getattr(exec_python._run_python, "original", exec_python._run_python)
_page: dict | None = None  # the page being rendered: its key, replayed or recorded outputs
_state: dict = {}


def on_config(config):
    default = Path(config.config_file_path).parent / ".cache" / "docs-exec"
    _state["folder"] = Path(os.environ.get("ATTNLAB_DOCS_CACHE", default))
    # The developer benchmarks (devbench/, beside mkdocs.yml) run on a page too.
    devbench = Path(config.config_file_path).parent / "devbench"
    _state["library"] = library_hash(Path(attnlab.__file__).parent) + (
        library_hash(devbench) if devbench.is_dir() else "")
    benchmarks = Path(config.config_file_path).parent / "benchmarks"
    tables: dict[str, list[str]] = {}
    for path in sorted(benchmarks.rglob("*")) if benchmarks.is_dir() else []:
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            tables.setdefault(path.name, []).append(digest)
    _state["tables"] = tables
    _state["hits"] = _state["runs"] = 0
    exec_python._run_python = _run_python
    return config


def on_page_markdown(markdown, page, **kwargs):
    global _page
    blocks = executed_blocks(markdown)
    if not blocks:
        _page = None
        return markdown
    code = [[info, without_comments(body)] for info, body in blocks]
    read = [[name, digests] for name, digests in _state["tables"].items()
            if any(name in body for _, body in blocks)]
    key = hashlib.sha256(json.dumps([_state["library"], code, read]).encode()).hexdigest()
    entry = _state["folder"] / f"{key}.json"
    replay = None
    if entry.is_file():
        outputs = json.loads(entry.read_text(encoding="utf-8"))
        replay = outputs if len(outputs) == len(blocks) else None
    _page = {"entry": entry, "count": len(blocks), "replay": replay, "outputs": [],
             "replayed": 0, "failed": False}
    return markdown


def on_page_content(html, page, **kwargs):
    global _page
    if _page is not None:
        if _page["replay"] is not None:
            _state["hits"] += 1
        elif not _page["failed"] and len(_page["outputs"]) == _page["count"]:
            _state["runs"] += 1
            entry = _page["entry"]
            entry.parent.mkdir(parents=True, exist_ok=True)
            partial = entry.with_suffix(".tmp")
            partial.write_text(json.dumps(_page["outputs"]), encoding="utf-8")
            partial.replace(entry)  # whole or absent, even if the build is stopped here
    _page = None
    return html


def on_post_build(config, **kwargs):
    log.info("exec_cache: %d pages replayed, %d run and cached (%s)",
             _state["hits"], _state["runs"], _state["folder"])


def _run_python(code, returncode=None, session=None, id=None, **extra):
    """markdown-exec's runner, replaying the page's recorded outputs when it has them."""
    if _page is None:
        return _original_run(code, returncode, session, id, **extra)
    if _page["replay"] is not None:
        n = _page["replayed"]
        _page["replayed"] = n + 1
        return _page["replay"][n]
    try:
        output = _original_run(code, returncode, session, id, **extra)
    except Exception:
        _page["failed"] = True
        raise
    _page["outputs"].append(output)
    return output


_run_python.original = _original_run


def executed_blocks(markdown: str) -> list[list[str]]:
    """The page's ``exec="on"`` blocks as [info string, body], in order (nested ones too)."""
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        body = []
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if (closing and closing["fence"].startswith(opening["fence"])
                    and not closing["info"].strip()):
                break
            body.append(lines[i].removeprefix(opening["indent"]))
            i += 1
        i += 1
        if 'exec="on"' in opening["info"]:
            blocks.append([opening["info"].strip(), "\n".join(body)])
    return blocks


def without_comments(code: str) -> str | list[list]:
    """The tokens of ``code`` that run, as [type, text] pairs: comments and the line breaks
    of comment-only lines left out. Code that does not tokenize is kept as it is."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return code
    return [[t.type, t.string] for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]


def library_hash(package: Path) -> str:
    """SHA-256 of the package's files (path and bytes), the Python and the torch versions."""
    digest = hashlib.sha256(f"{sys.version}\n{torch.__version__}\n".encode())
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so":
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
