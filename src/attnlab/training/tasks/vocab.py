"""Character vocabularies with the special tokens every task shares."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BOS", "EOS", "PAD", "SPECIALS", "UNK", "CharVocab", "describe_characters"]

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


@dataclass(frozen=True)
class CharVocab:
    """A character-level vocabulary: ids 0..3 are ``<pad> <bos> <eos> <unk>``, then ``chars``."""

    chars: str

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharVocab:
        """The sorted set of characters in ``texts``."""
        return cls("".join(sorted(set("".join(texts)))))

    def __len__(self) -> int:
        return len(SPECIALS) + len(self.chars)

    @property
    def stoi(self) -> dict[str, int]:
        return {c: i + len(SPECIALS) for i, c in enumerate(self.chars)}

    def unknown(self, text: str) -> str:
        """The distinct characters of ``text`` outside the vocabulary, in order of appearance."""
        table = self.stoi
        return "".join(dict.fromkeys(c for c in text if c not in table))

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Characters -> ids (unknown characters -> ``<unk>``)."""
        table = self.stoi
        ids = [table.get(c, UNK) for c in text]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text, stopping at ``<eos>`` and skipping the other special tokens."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def read(self, ids: Iterable[int]) -> tuple[str, int | None]:
        """Ids -> the text before the first special token, and that token's id (None when
        there is none): unlike ``decode``, a model's stray ``<pad>``/``<bos>``/``<unk>`` is
        not skipped over but seen."""
        out = []
        for i in ids:
            i = int(i)
            if i < len(SPECIALS):
                return "".join(out), i
            out.append(self.chars[i - len(SPECIALS)])
        return "".join(out), None

    def batch(self, texts: list[str], *, bos: bool = False, eos: bool = False) -> Tensor:
        """Encode and right-pad with ``<pad>``: ``B x T`` long tensor."""
        seqs = [self.encode(t, bos=bos, eos=eos) for t in texts]
        width = max((len(s) for s in seqs), default=0)
        out = torch.full((len(seqs), width), PAD, dtype=torch.long)
        for row, s in enumerate(seqs):
            out[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out


def describe_characters(chars: str, limit: int = 10) -> str:
    """``chars`` for an error message: each quoted with its code point (``'§' (U+00A7)``), so
    that invisible and look-alike characters can be told apart; at most ``limit`` of them."""
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars[:limit])
    more = len(chars) - limit
    return shown + (f" and {more} more" if more > 0 else "")
