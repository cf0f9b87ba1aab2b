"""One choice's log-probabilities as the server reports them, in OpenAI's two forms.

The engine gives each token's ``TokenLogprobs`` (and, with ``echo``, the prompt's, on the
first token's event); this turns them into ``attnlab.generation.logprobs.TokenEntry``s (text,
bytes, offset in the answer's text, alternatives) and then into the completions form
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) or the chat form
(``content: [{token, logprob, bytes, top_logprobs}]``). ``take()`` gives the entries not
given yet (one stream chunk's), ``whole()`` all of them (a non-streamed answer).

Offsets count characters of the choice's text: with ``echo`` it begins with the prompt's
text (``decode(prompt)``, whose tokens come first, the first without a value), else with the
first new token.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnlab.generation.logprobs import chat_logprobs, completions_logprobs, token_entries
from attnlab.serving.params import TokenLogprobs
from attnlab.tokenizer import Tokenizer

__all__ = ["ChoiceLogprobs"]


class ChoiceLogprobs:
    """``add`` each new token with its entry (``add_prompt`` the prompt's, with ``echo``);
    ``take`` / ``whole`` the form of ``chat`` or completions."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], *, chat: bool,
                 echo: bool) -> None:
        self.tokenizer, self.prompt, self.chat, self.echo = tokenizer, list(prompt), chat, echo
        self.echo_text = tokenizer.decode(self.prompt) if echo else ""
        self.ids: list[int] = []
        self.values: list[TokenLogprobs] = []
        self.prompt_values: tuple[TokenLogprobs, ...] = ()
        self._taken = 0  # new tokens given by take()
        self._prompt_taken = False
        self._entries: list = []  # every entry given so far, for whole()

    def add_prompt(self, values: Sequence[TokenLogprobs]) -> None:
        self.prompt_values = tuple(values)

    def add(self, token: int, value: TokenLogprobs) -> None:
        self.ids.append(token)
        self.values.append(value)

    def take(self) -> dict:
        """The form of the entries not given yet (the prompt's first, with ``echo``)."""
        entries = []
        if self.echo and self.prompt_values and not self._prompt_taken:
            entries += _entries(self.prompt, self.prompt_values, self.tokenizer)
            self._prompt_taken = True
        a = self._taken
        if a < len(self.ids):
            context = self.prompt + self.ids[:a]
            start = (len(self.echo_text) + len(self.tokenizer.decode(context))
                     - len(self.tokenizer.decode(self.prompt)))
            entries += _entries(self.ids[a:], self.values[a:], self.tokenizer,
                                context=context, start_offset=start)
            self._taken = len(self.ids)
        self._entries += entries
        return self._form(entries)

    def whole(self) -> dict:
        """The form of every entry."""
        self.take()
        return self._form(self._entries)

    def _form(self, entries: list) -> dict:
        return chat_logprobs(entries) if self.chat else completions_logprobs(entries)


def _entries(ids: Sequence[int], values: Sequence[TokenLogprobs], tokenizer: Tokenizer,
             **where: object) -> list:
    return token_entries(ids, [v.logprob for v in values], [v.top_ids for v in values],
                         [v.top_logprobs for v in values], tokenizer, **where)
