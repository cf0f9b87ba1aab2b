"""A checkpoint's generation defaults: the fields of ``generation_config.json`` that
``generate`` understands, read as Hugging Face's ``GenerationConfig`` reads them.

A field that is absent or ``null`` is *not set* (``None`` here), and the caller's own default
applies. Unknown fields (``transformers_version``, ``bos_token_id``, ...) are ignored. As in
transformers, ``top_k = 0`` means no top-k filter (``None`` here). The file is plain JSON
(no ``NaN``/``Infinity``); every field's type and range is checked, and a bad one gives a
``ValueError`` naming the field and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from attnlab._checks import is_int, is_number

__all__ = ["GENERATION_CONFIG_NAME", "GenerationConfig", "read_generation_config"]

GENERATION_CONFIG_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfig:
    """Generation defaults; ``None`` = not set. ``eos_token_id`` is always a tuple when set
    (the file may hold one id or a list). ``path`` names the file it came from."""

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    max_new_tokens: int | None = None
    max_length: int | None = None
    path: str = GENERATION_CONFIG_NAME

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "path" and getattr(self, f.name) is not None:
                _CHECKS[f.name](self, f.name, getattr(self, f.name))
        eos = self.eos_token_id
        if eos is not None:
            object.__setattr__(self, "eos_token_id",
                               tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        if self.top_k == 0:  # transformers: 0 disables the filter
            object.__setattr__(self, "top_k", None)

    def _fail(self, name: str, value: object, expected: str) -> None:
        raise ValueError(f"{self.path}: {name}: expected {expected}, got {value!r}")


def read_generation_config(folder: str | Path) -> GenerationConfig:
    """``folder/generation_config.json`` as a ``GenerationConfig``; every field unset when the
    folder has no such file."""
    path = Path(folder) / GENERATION_CONFIG_NAME
    if not path.is_file():
        return GenerationConfig(path=str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: expected a JSON object of generation settings, got "
                         f"invalid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of generation settings, got "
                         f"{type(data).__name__}")
    known = {f.name for f in fields(GenerationConfig)} - {"path"}
    return GenerationConfig(**{k: v for k, v in data.items() if k in known}, path=str(path))


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _check_bool(config: GenerationConfig, name: str, value: object) -> None:
    if not isinstance(value, bool):
        config._fail(name, value, "true or false")


def _check_temperature(config: GenerationConfig, name: str, value: object) -> None:
    if not is_number(value, finite=True) or value < 0:
        config._fail(name, value, "a finite number >= 0")


def _check_positive_number(config: GenerationConfig, name: str, value: object) -> None:
    if not is_number(value, finite=True) or value <= 0:
        config._fail(name, value, "a finite number > 0")


def _check_top_p(config: GenerationConfig, name: str, value: object) -> None:
    if not is_number(value, finite=True) or not 0 < value <= 1:
        config._fail(name, value, "a number in (0, 1]")


def _check_min_p(config: GenerationConfig, name: str, value: object) -> None:
    if not is_number(value, finite=True) or not 0 <= value <= 1:
        config._fail(name, value, "a number in [0, 1]")


def _check_count(config: GenerationConfig, name: str, value: object) -> None:
    if not is_int(value) or value < 0:
        config._fail(name, value, "an int >= 0")


def _check_token(config: GenerationConfig, name: str, value: object) -> None:
    if not is_int(value) or value < 0:
        config._fail(name, value, "a token id (an int >= 0)")


def _check_eos(config: GenerationConfig, name: str, value: object) -> None:
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not ids or not all(is_int(i) and i >= 0 for i in ids):
        config._fail(name, value, "a token id (an int >= 0) or a non-empty list of them")


_CHECKS = {
    "do_sample": _check_bool,
    "temperature": _check_temperature,
    "top_k": _check_count,
    "top_p": _check_top_p,
    "min_p": _check_min_p,
    "repetition_penalty": _check_positive_number,
    "eos_token_id": _check_eos,
    "pad_token_id": _check_token,
    "max_new_tokens": _check_count,
    "max_length": _check_count,
}
