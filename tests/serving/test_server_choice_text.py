"""``ChoiceText``: the text sent piece by piece equals the whole decoded text cut before the
first stop string, whatever the tokens and the stop strings (hypothesis), and a tail that may
begin a stop string is held back until it is decided."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.serving.choice_text import ChoiceText
from attnlab.tokenizer import Tokenizer
from test_cli_generate import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


def expected(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The reference: decode everything, cut at the earliest stop (no stop: all of it)."""
    text = tok.decode(ids, skip_special_tokens=True)
    found = [text.find(s) for s in stops if s in text]
    return (text[:min(found)], True) if found else (text, False)


def run(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[list[str], bool, int]:
    choice = ChoiceText(tok, tuple(stops))
    pieces, used = [], 0
    for token in ids:
        used += 1
        done = choice.push(token)
        pieces.append(choice.take())
        if done:
            break
    choice.finish()
    pieces.append(choice.take(final=True))
    return pieces, choice.stopped, used


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_pieces_join_to_the_text_cut_at_the_first_stop(tok, data) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    whole = tok.decode(ids, skip_special_tokens=True)
    # Stops drawn from the text itself (so that they occur) and arbitrary ones.
    inside = st.builds(lambda i, n: whole[i:i + n], st.integers(0, max(len(whole) - 1, 0)),
                       st.integers(1, 4)).filter(bool)
    stops = data.draw(st.lists(inside | st.text(min_size=1, max_size=3), max_size=3))
    pieces, stopped, used = run(tok, ids, stops)
    text, should_stop = expected(tok, ids, stops)
    assert "".join(pieces) == text
    assert stopped == should_stop
    if stopped:  # it stopped at the token that completed the stop, not later (a trailing
        # partial character, U+FFFD, is not text yet)
        before = tok.decode(ids[:used - 1], skip_special_tokens=True).rstrip("\ufffd")
        assert not any(s in before for s in stops)


def test_a_possible_stop_is_held_back_until_decided(tok) -> None:
    ids = tok.encode("the fox said hello")
    choice = ChoiceText(tok, ("fox said no",))
    sent = ""
    for token in ids:
        choice.push(token)
        sent += choice.take()
        assert not sent.endswith("fox")  # "fox..." could begin the stop: not sent yet
    choice.finish()
    sent += choice.take(final=True)
    assert sent == "the fox said hello" and not choice.stopped
