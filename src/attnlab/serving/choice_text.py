"""One choice's text as its tokens arrive: decoded incrementally, cut at the first stop string,
and released only when no stop string can still begin in it.

The tokens are decoded by ``attnlab.tokenizer.TextStreamer`` (special tokens skipped but
those in ``keep``, the markers a tool call parser reads; a partial UTF-8 character held
back). A stop string is looked for in the decoded text, not in the tokens, since a stop string
may start or end inside a token; the text is cut before it (OpenAI's ``stop``). While the text
ends in the beginning of a stop string, that tail is held back: it is sent when the next
tokens show it is not a stop, or dropped when it is.
"""

from __future__ import annotations

import torch

from attnlab.tokenizer import TextStreamer, Tokenizer

__all__ = ["ChoiceText"]


class ChoiceText:
    """``push`` each new token id; ``take`` the text that is safe to send."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = (), *,
                 keep: frozenset[int] = frozenset()) -> None:
        self.stops = stops
        self.text = ""  # decoded so far, cut at a stop once one is seen
        self.tokens = 0
        self.stopped = False  # a stop string was found
        self._sent = 0  # characters of text already taken
        self._checked = 0  # characters of text searched for stops
        self._streamer = TextStreamer(tokenizer, self._append, keep=keep)

    def push(self, token_id: int) -> bool:
        """Add a token; True when the text now holds a stop string (the request is done)."""
        self.tokens += 1
        if not self.stopped:
            self._streamer.put(torch.tensor([token_id]))
        return self.stopped

    def finish(self) -> None:
        """No more tokens: flush a held partial character."""
        if not self.stopped:
            self._streamer.end()

    def take(self, final: bool = False) -> str:
        """The text not taken yet, less a tail that may be the start of a stop string (all of
        it when ``final`` or once a stop was found)."""
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held()
        piece = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece

    def _append(self, piece: str) -> None:
        if self.stopped:
            return
        self.text += piece
        if not self.stops:
            return
        # A stop found now ends after the text searched before: start one stop length back.
        start = max(0, self._checked - max(map(len, self.stops)) + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
        self._checked = len(self.text)

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self.text[self._sent:]
        for k in range(min(len(tail), max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0
