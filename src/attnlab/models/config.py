"""JSON round-trips shared by the model configs (frozen dataclasses)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigMixin"]

C = TypeVar("C", bound="ConfigMixin")


class ConfigMixin:
    """``to_dict``/``from_dict`` and ``to_json``/``from_json`` for a frozen dataclass."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Build from a dict; unknown keys raise a ``ValueError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"data: unknown {cls.__name__} fields {unknown}; "
                             f"expected some of {sorted(names)}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls: type[C], text_or_path: str | Path) -> C:
        """Read from JSON text or from a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))
