"""Frozen dataclass configs: field types checked from the type hints, and JSON round trips.

``ConfigMixin._check_types()`` (called first in each config's ``__post_init__``) checks every
field against its type hint, so ``"norm_first": "no"`` or ``"eos_token_id": "2"`` in a file
raise instead of being read as ``True`` or a string: a bool is not an int, an int is accepted
(and stored) as a float, a list as a tuple, ``None`` only for ``Optional`` fields, a
``Literal`` field only takes its choices, and a float must be finite (JSON allows ``NaN``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from attnlab._checks import is_number
from attnlab.models.hf_loading import read_json

__all__ = ["ConfigMixin", "check_value"]

C = TypeVar("C", bound="ConfigMixin")


def check_value(name: str, value: Any, hint: Any) -> Any:
    """``value`` when it fits the type ``hint``, normalised (int -> float, list -> tuple).

    Handles ``bool``, ``int``, ``float``, ``str``, ``None``, unions, ``Literal[...]``,
    ``tuple[X, ...]``, ``tuple[X, Y]`` and ``list[X]``. A value of the wrong type raises a
    ``TypeError``, a wrong ``Literal`` choice or a non-finite float a ``ValueError``; both name
    ``name``, the value received and what was expected.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            try:
                return check_value(name, value, option)
            except (TypeError, ValueError):
                continue
        raise TypeError(_message(name, value, hint))
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError(_message(name, value, hint))
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise TypeError(_message(name, value, hint))
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ValueError(_message(name, value, hint))
            items = [check_value(f"{name}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]
        else:
            items = [check_value(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
        return origin(items)
    if hint is float:
        if not is_number(value):
            raise TypeError(_message(name, value, hint))
        if not is_number(value, finite=True):
            raise ValueError(_message(name, value, hint))
        return float(value)
    if hint is type(None) or hint is None:
        if value is not None:
            raise TypeError(_message(name, value, hint))
        return None
    if hint is Any:
        return value
    if hint is int and isinstance(value, bool):
        raise TypeError(_message(name, value, hint))
    if not isinstance(value, hint):
        raise TypeError(_message(name, value, hint))
    return value


class ConfigMixin:
    """Type checks from the field hints, ``to_dict``/``from_dict``, ``to_json``/``from_json``."""

    def _check_types(self) -> None:
        """Check every field against its type hint; store the normalised values."""
        hints = _field_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            checked = check_value(f.name, value, hints[f.name])
            if checked is not value:
                object.__setattr__(self, f.name, checked)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], *, source: str | Path | None = None
                  ) -> C:
        """Build from a mapping of field values; every error names ``source`` when given.

        ``source`` is where ``data`` came from (a file path), put in front of the messages:
        unknown or missing fields and wrongly typed or invalid values raise a ``ValueError``
        or ``TypeError`` naming the field, the value and what was expected.
        """
        where = "data" if source is None else str(source)
        if not isinstance(data, Mapping):
            raise TypeError(f"{where}: expected a mapping (a JSON object) of {cls.__name__} "
                            f"fields, got {type(data).__name__}")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        names = {f.name for f in fields}
        unknown = sorted(set(data) - names, key=str)
        if unknown:
            raise ValueError(f"{where}: unknown {cls.__name__} fields {unknown}; "
                             f"expected some of {sorted(names)}")
        missing = [f.name for f in fields if f.name not in data
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{where}: missing {cls.__name__} field {missing[0]!r}; "
                             f"required fields: {missing}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as error:
            if source is None:
                raise
            raise type(error)(f"{source}: {error}") from None

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls: type[C], text_or_path: str | Path) -> C:
        """Read from JSON text (starting with ``{``) or from a file path."""
        text = str(text_or_path)
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ValueError(f"text_or_path: not valid JSON ({error})") from None
            return cls.from_dict(data)
        return cls.from_dict(read_json(text_or_path), source=text_or_path)


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def _message(name: str, value: Any, hint: Any) -> str:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{name}: expected {_describe(hint)}, got {shown} ({type(value).__name__})"


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return f"one of {args}"
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
        return f"a list, each item {_describe(args[0])}"
    names = {bool: "a bool (true/false)", int: "an int", float: "a finite number",
             str: "a string", type(None): "null (None)"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
