"""A small table of results (head report, head importance) that prints as markdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Table"]


@dataclass
class Table:
    """``columns`` names and ``rows`` of values; ``str(table)`` is a markdown table."""

    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def to_markdown(self, digits: int = 3) -> str:
        """Markdown with floats rounded to ``digits`` decimals."""

        def cell(v: Any) -> str:
            return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "|".join("---" for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def to_dicts(self) -> list[dict[str, Any]]:
        """One ``{column: value}`` per row."""
        return [dict(zip(self.columns, row)) for row in self.rows]

    def column(self, name: str) -> list[Any]:
        """The values of column ``name``."""
        if name not in self.columns:
            raise KeyError(f"name: expected one of {self.columns}, got {name!r}")
        i = self.columns.index(name)
        return [row[i] for row in self.rows]

    def __str__(self) -> str:
        return self.to_markdown()

    def __len__(self) -> int:
        return len(self.rows)
