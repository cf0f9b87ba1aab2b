"""Stop strings decoded from a bounded tail of the new tokens stop each row at the same token
as decoding the whole new text at every step (the reference), for tokenizers whose tails
decode differently from the middle of a text (byte-level, SentencePiece-style)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation.stopping import StopStrings


class Bytes:
    """Byte-level: token i is the byte i; a tail may start inside a character (decoded "\ufffd")."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class Pieces:
    """SentencePiece-style: "\u2581" marks a space, and the text's first space is dropped."""

    PIECES = ("\u2581a", "b", "\u2581c", "d", "\u2581", "\u2581ab")

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES[i] for i in ids).replace("\u2581", " ").removeprefix(" ")


class Recording(Bytes):
    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return super().decode(ids)


# ASCII letters, the two bytes of "\u00e9" and the three of "\u20ac": characters split across
# tokens, and stray continuation bytes.
BYTE_IDS = [ord("a"), ord("b"), 0xC3, 0xA9, 0xE2, 0x82, 0xAC]


def first_stops(stop: StopStrings, new_ids: torch.Tensor) -> list[int | None]:
    """The step (1-based) at which each row finishes, calling ``stop`` as ``generate`` does."""
    active = torch.ones(new_ids.shape[0], dtype=torch.bool)
    finished: list[int | None] = [None] * new_ids.shape[0]
    for n in range(1, new_ids.shape[1] + 1):
        done = stop(new_ids[:, :n], active)
        for row in (done & active).nonzero().flatten().tolist():
            finished[row] = n
        active &= ~done
    return finished


def reference(tokenizer, strings: list[str], rows: list[list[int]]) -> list[int | None]:
    return [next((n for n in range(1, len(row) + 1)
                  if any(s in tokenizer.decode(row[:n]) for s in strings)), None)
            for row in rows]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tail_stops_equal_whole_text_stops(data) -> None:
    tokenizer = data.draw(st.sampled_from([Bytes(), Pieces()]))
    ids = st.sampled_from(BYTE_IDS) if isinstance(tokenizer, Bytes) else \
        st.integers(0, len(Pieces.PIECES) - 1)
    length = data.draw(st.integers(1, 30))
    rows = data.draw(st.lists(st.lists(ids, min_size=length, max_size=length), min_size=1,
                              max_size=3))
    # Stop strings cut from the rows' own text (so that they occur) and a few free ones.
    texts = [tokenizer.decode(row) for row in rows]
    cut = st.sampled_from(texts).flatmap(lambda t: st.tuples(
        st.integers(0, len(t)), st.integers(1, 8)).map(lambda ij: t[ij[0]:ij[0] + ij[1]]))
    free = st.text("ab \u00e9\u20ac\ufffdcd", min_size=1, max_size=4)
    strings = [s for s in data.draw(st.lists(cut | free, min_size=1, max_size=3)) if s] or ["x"]
    stop = StopStrings(strings, tokenizer)
    assert first_stops(stop, torch.tensor(rows)) == reference(tokenizer, strings, rows)


@pytest.mark.parametrize(("rows", "strings"), [
    # "\u20ac" is three tokens: it completes on the third, decoded "\ufffd" before.
    ([[ord("a")] * 12 + [0xE2, 0x82, 0xAC, ord("b")]], ["a\u20ac"]),
    # a tail that starts inside "\u00e9" shows "\ufffd", which the whole text never holds.
    ([[0xC3, 0xA9] * 8], ["\ufffd\u00e9"]),
])
def test_byte_level_characters_split_across_tokens(rows, strings) -> None:
    stop = StopStrings(strings, Bytes())
    assert first_stops(stop, torch.tensor(rows)) == reference(Bytes(), strings, rows)


def test_a_space_that_a_tail_would_drop_still_stops_the_row() -> None:
    # "bbbbbb b": " b" ends at the last token, the space a token of its own; the tail of
    # just those two tokens would read "b" (the first space dropped).
    rows = [[1, 1, 1, 1, 1, 1, 4, 1]]
    stop = StopStrings([" b"], Pieces())
    assert first_stops(stop, torch.tensor(rows)) == [8] == reference(Pieces(), [" b"], rows)


def test_each_step_decodes_a_bounded_tail() -> None:
    tokenizer = Recording()
    row = [ord("a")] * 200 + [ord("b"), ord("b")]
    stop = StopStrings(["abb", "\u00e9"], tokenizer)  # the longest is 3 bytes: tails of 4
    assert first_stops(stop, torch.tensor([row])) == [202]
    assert stop.window == 4
    # One tail a step, then the whole text once to confirm the match.
    assert tokenizer.lengths == [min(n, 4) for n in range(1, 203)] + [202]


def test_a_decoder_that_returns_no_str_is_named() -> None:
    class Listing:
        def decode(self, ids: list[int]) -> list[str]:
            return ["ab" for _ in ids]

    stop = StopStrings(["ab"], Listing())
    with pytest.raises(TypeError, match="tokenizer: expected decode\\(ids\\) to return a str, "
                                        "got list"):
        stop(torch.tensor([[1, 2]]), torch.tensor([True]))
