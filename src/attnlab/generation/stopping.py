"""Stop strings: a row of ``generate`` finishes when the text of its new tokens contains one.

Hugging Face (``generate(stop_strings=..., tokenizer=...)``) stops a row at the token that
completes a stop string, that token included, even when the token runs past the string's end
("st" + "opera" completes "stop"). Checking after every token whether the decoded new text
contains the string gives the same step: the first time it does, the last token completed it.
One difference: Hugging Face also matches a string that begins in the prompt; here only the
new text counts (the prompt may well contain a stop string, e.g. a chat's past turns).

Decoding the whole new text at every step would cost ``O(n^2)`` over ``n`` tokens; only a
tail is decoded. A string that first appears at this step ends in the newest token's text,
and every token carries at least one byte of text, so the longest string's ``b`` bytes lie
within the last ``b`` tokens; one more token gives the decoder the context that a tail's
first token lacks (SentencePiece drops a first token's leading space, a byte-level tail may
start inside a character). A match in the tail is confirmed on the whole new text (once per
finished row), so a decoder that reads a tail's start differently cannot stop a row early.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Decoder", "StopStrings"]


class Decoder(Protocol):
    """Anything with ``decode(ids) -> str``: ``attnlab.tokenizer.Tokenizer`` or a Hugging Face
    tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


class StopStrings:
    """``stop(new_ids, active) -> rows done``: which rows' new text contains a stop string.

    new_ids ``B x n`` (the tokens generated so far), active ``B`` bool (rows still running;
    the others are skipped) -> bool ``B``. Each call decodes the last ``window`` new tokens of
    every active row (module docstring), special tokens included (as their text), as Hugging
    Face's criterion sees them; it assumes that the rows did not hold a stop string before
    the newest token, as ``generate``, which calls it after every token, guarantees.
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
        # surrogatepass: a lone surrogate is never decoded text, but must not crash the count.
        self.window = max(len(s.encode("utf-8", "surrogatepass")) for s in self.strings) + 1

    def __call__(self, new_ids: Tensor, active: Tensor) -> Tensor:
        done = active.clone()
        rows = active.nonzero().flatten().tolist()
        if not rows:
            return done
        tails = new_ids[rows, -self.window:].tolist()  # one read back for the batch
        done[rows] = torch.tensor([self._holds(tail) and self._holds(new_ids[row].tolist())
                                   for row, tail in zip(rows, tails)], device=done.device)
        return done

    def _holds(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids)
        if not isinstance(text, str):  # `in` would test list membership, silently wrong
            raise TypeError(f"tokenizer: expected decode(ids) to return a str, got "
                            f"{type(text).__name__}")
        return any(s in text for s in self.strings)
