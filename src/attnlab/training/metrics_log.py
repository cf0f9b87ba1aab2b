"""``metrics.jsonl``: one JSON object per line, each with the ``step`` it describes.

A resumed run first drops the records past the step it resumes from (written by the run
after its last checkpoint, or a line torn by a kill), so no step is ever recorded twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from attnlab._checks import is_int
from attnlab.durable import write_text_atomic

__all__ = ["append_record", "drop_records_after"]


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` (with an int ``step``) as one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def drop_records_after(path: Path, step: int) -> None:
    """Keep the records of steps ``<= step``; the file is replaced in one atomic step."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    keep = [line for line in lines if _record_step(line) <= step]
    if keep != lines:
        write_text_atomic(path, "".join(keep))


def _record_step(line: str) -> float:
    """The step of a line; infinity for a torn or foreign line (dropped)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return math.inf
    step = record.get("step") if isinstance(record, dict) else None
    if not line.endswith("\n") or not is_int(step):
        return math.inf
    return step
