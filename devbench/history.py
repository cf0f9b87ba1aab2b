"""The ``## History`` of a committed benchmark table: a new run goes on top, the runs already
in the file stay below it, newest first, each headed by its machine and date, so that one
machine's figures are never presented as the project's and the older ones stay readable.

``keep_history(folder)`` wraps a run of any benchmark (``python -m devbench NAME``): the
markdown files that the run rewrote in ``folder`` get back the runs that they held before.
``attnlab bench`` (a user's own measurement, written to ``runs/bench``) writes its table alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from attnlab.durable import write_text_atomic

__all__ = ["HISTORY", "keep_history", "write_with_history"]

HISTORY = "## History"


@contextmanager
def keep_history(folder: Path) -> Iterator[None]:
    """Around a benchmark run that writes markdown tables into ``folder`` (recursively): each
    table that the run rewrote keeps the runs that it held before (``write_with_history``)."""
    folder = Path(folder)
    before = {path: path.read_text(encoding="utf-8", errors="replace")
              for path in folder.rglob("*.md")} if folder.is_dir() else {}
    yield
    for path in sorted(folder.rglob("*.md")):
        new = path.read_text(encoding="utf-8", errors="replace")
        old = before.get(path, "")
        if new != old:
            write_with_history(path, new, old=old)


def write_with_history(path: Path, text: str, *, old: str | None = None) -> Path:
    """Write the markdown ``text`` of a new run to ``path``, keeping the runs already there.

    ``old``: the file's text before the run (default: read from ``path``). The new run goes
    on top; the run that was on top moves into the ``## History`` section
    below it (newest first), headed by its machine (the ``- gpu:`` and ``- cpu:`` lines of
    ``machine_section``) and its ``- measured:`` date, its own headings two levels down. So
    one machine's figures are never presented as the project's, and the older ones stay
    readable.
    """
    path = Path(path)
    if old is None:
        # A byte that is not UTF-8 (an edit by hand) must not lose the run just measured.
        old = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    current, _, history = old.partition(f"\n{HISTORY}\n")
    entries = [history.strip()] if history.strip() else []
    if current.strip():
        entries.insert(0, _as_history_entry(current))
    sections = [text.rstrip("\n")]
    if entries:
        sections += [HISTORY, "\n\n".join(entries)]
    # In one step: a kill mid-write must not lose the history the file held.
    write_text_atomic(path, "\n\n".join(sections) + "\n")
    return path


def _as_history_entry(markdown: str) -> str:
    """A run's markdown as one ``### <cpu>, <date>`` entry of the history section."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    cpu = next((line.split(":", 1)[1].strip() for line in lines
                if line.startswith("- cpu:")), "machine not recorded")
    gpu = next((line.split(":", 1)[1].strip() for line in lines
                if line.startswith("- gpu:")), None)
    date = next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("- measured:")), None)
    label = ", ".join(x for x in (gpu, cpu, date) if x)
    body = [("##" + line) if line.startswith("#") else line for line in lines]
    return "\n".join([f"### {label}", *body]).strip()
