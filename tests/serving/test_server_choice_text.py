"""``ChoiceText``: the text sent piece by piece equals the text decoded so far, cut before
the earliest stop string, at the first token whose text holds one (the point where generation
stops), whatever the tokens and the stop strings (hypothesis); a tail that may begin a stop
string is held back until it is decided."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.serving.choice_text import ChoiceText
from attnlab.tokenizer import TextStreamer, Tokenizer
from tiny_folders import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


def expected(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool, int]:
    """The reference: after each token, the text so far (as ``TextStreamer`` writes it: a
    partial character waits); at the first token whose text holds a stop, that text cut
    before its earliest stop. Returns (text, stopped, tokens used)."""
    written: list[str] = []
    streamer = TextStreamer(tok, written.append)
    for k, token in enumerate(ids, 1):
        streamer.put(torch.tensor([token]))
        if k == len(ids):
            streamer.end()
        text = "".join(written)
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], True, k
    return "".join(written), False, len(ids)


def run(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool, int]:
    """ChoiceText fed token by token; its pieces joined."""
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
    return "".join(pieces), choice.stopped, used


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_pieces_join_to_the_text_cut_at_the_first_stop(tok, data) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    whole = tok.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
    # Stops drawn from the text itself (so that they occur) and arbitrary ones.
    inside = st.builds(lambda i, n: whole[i:i + n], st.integers(0, max(len(whole) - 1, 0)),
                       st.integers(1, 4)).filter(bool)
    stops = data.draw(st.lists(inside | st.text(min_size=1, max_size=3), max_size=3))
    assert run(tok, ids, stops) == expected(tok, ids, stops)


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
