"""Stop strings: a row of ``generate`` finishes when the text of its new tokens contains one.

Hugging Face (``generate(stop_strings=..., tokenizer=...)``) stops a row at the token that
completes a stop string, that token included, even when the token runs past the string's end
("st" + "opera" completes "stop"). Checking after every token whether the decoded new text
contains the string gives the same step: the first time it does, the last token completed it.
One difference: Hugging Face also matches a string that begins in the prompt; here only the
new text counts (the prompt may well contain a stop string, e.g. a chat's past turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

__all__ = ["Decoder", "StopStrings"]


class Decoder(Protocol):
    """Anything with ``decode(ids) -> str``: ``attnlab.tokenizer.Tokenizer`` or a Hugging Face
    tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


class StopStrings:
    """``stop(new_ids, active) -> rows done``: which rows' new text contains a stop string.

    new_ids ``B x n`` (the tokens generated so far), active ``B`` bool (rows still running;
    the others are skipped) -> bool ``B``. Each call decodes every active row's new tokens,
    special tokens included (as their text), as Hugging Face's criterion sees them.
    """

    def __init__(self, stop_strings: str | Sequence[str], tokenizer: Decoder | None) -> None:
        strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if not isinstance(strings, Sequence) or not strings or not all(
                isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings: expected a non-empty string or a non-empty list of "
                             f"non-empty strings, got {stop_strings!r}")
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer: stop_strings need a tokenizer (an object with "
                             f"decode(ids) -> str) to read the new text, got {tokenizer!r}")
        self.strings = tuple(strings)
        self.tokenizer = tokenizer

    def __call__(self, new_ids: Tensor, active: Tensor) -> Tensor:
        done = active.clone()
        for row in active.nonzero().flatten().tolist():
            text = self.tokenizer.decode(new_ids[row].tolist())
            done[row] = any(s in text for s in self.strings)
        return done
