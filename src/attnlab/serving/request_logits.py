"""What the engine does to one request's logits beyond the plain sampler, in one place: the
OpenAI controls of its ``SamplingParams`` and the log-probabilities it reports.

Per decoding step, for the requests whose next token is due (logits ``R x V``, one row each):

    raw = lm_head(hidden)                                     the model's logits
    logprobs: log_softmax(raw), the chosen token and the k most likely   (before anything)
    logits = grammar_mask(bias(penalties(repetition(raw))))   each only when the request asks
    token  = argmax(logits), or a draw from softmax(min_p(top_p(top_k(logits / T))))

the order of ``attnlab.generation.generate`` (``controls.py``), with the same pure functions
(``attnlab.generation.processors``, ``sampling.apply_repetition_penalty``), applied row by row
so that each request keeps its own settings inside the continuous batch. A row of a request
that asks for nothing is left as it is (no copy): the plain path costs nothing more. The
repetition penalty sees the prompt and the new tokens (as ``generate`` and vLLM), the
presence/frequency penalties the new tokens only (OpenAI's counts).

``prompt_logprobs``: the prompt's tokens' log-probabilities come from the hidden states of
every token of its prefill chunks (``ModelRunner.hidden_states``); token ``i`` is predicted
by position ``i - 1``, and the first has none. Such a request takes no prefix-cache pages
(``Scheduler``), so that every prompt position is computed.

Grammars (``json_schema``) compile once per schema and end ids (``GrammarCache``: tens of
milliseconds each), each request getting its own ``GrammarState``.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from attnlab.generation.grammar import GrammarState, JsonSchemaGrammar
from attnlab.generation.logprobs import step_logprobs
from attnlab.generation.processors import (
    apply_logit_bias,
    apply_penalties,
    logit_bias_tensor,
    token_counts,
)
from attnlab.generation.sampling import apply_repetition_penalty
from attnlab.serving.params import SamplingParams, TokenLogprobs

__all__ = ["GrammarCache", "RequestLogits", "process_rows"]

# Compiled grammars kept (least recently used dropped): a server sees a few schemas, reused.
GRAMMARS_KEPT = 32


class GrammarCache:
    """``JsonSchemaGrammar``s by schema and end ids, compiled once (thread-safe: the HTTP
    layer compiles a request's schema to refuse it early, the engine thread finds it)."""

    def __init__(self, tokenizer: object | None, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._kept: OrderedDict[str, JsonSchemaGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, schema: Mapping, eos: Sequence[int]) -> JsonSchemaGrammar:
        """The grammar of ``schema`` ending with ``eos``; a ``ValueError`` naming
        ``json_schema`` for a schema the engine cannot enforce (or without a tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("json_schema: the engine was made without a tokenizer, which a "
                             "grammar needs; expected Engine(..., tokenizer=...)")
        if not eos:
            raise ValueError("json_schema: a grammar ends a value with a stop token; expected "
                             "stop_token_ids, got none")
        key = json.dumps([schema, list(eos)], sort_keys=True)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        try:
            grammar = JsonSchemaGrammar(schema, self.tokenizer, vocab_size=self.vocab_size,
                                        eos_token_id=list(eos))
        except ValueError as error:
            raise ValueError(f"json_schema: {str(error).removeprefix('schema: ')}") from None
        with self._lock:
            self._kept[key] = grammar
            while len(self._kept) > GRAMMARS_KEPT:
                self._kept.popitem(last=False)
        return grammar


class RequestLogits:
    """One request's processors and log-probabilities (module docstring). ``grammar``: its
    compiled ``json_schema``, if any; ``vocab_size``: the model's ``V``."""

    def __init__(self, params: SamplingParams, prompt_length: int, vocab_size: int,
                 grammar: JsonSchemaGrammar | None = None) -> None:
        self.params, self.prompt_length = params, prompt_length
        self.bias = (None if not params.logit_bias else
                     logit_bias_tensor(params.logit_bias, 1, vocab_size)[0])
        self.state: GrammarState | None = None if grammar is None else grammar.start()
        self.prompt: dict[int, TokenLogprobs] = {}  # prompt position -> its entry
        self.prompt_taken = False

    @property
    def active(self) -> bool:
        """Whether any processor changes this request's logits."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0
                or p.frequency_penalty != 0 or self.bias is not None or self.state is not None)

    def process(self, logits: Tensor, tokens: Sequence[int]) -> Tensor:
        """The processors on one row: logits ``V`` -> ``V``; ``tokens``: the prompt and the
        new tokens so far."""
        p = self.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor([list(tokens)], device=logits.device)
            logits = apply_repetition_penalty(logits[None], ids, p.repetition_penalty)[0]
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            new = torch.tensor([list(tokens[self.prompt_length:])], dtype=torch.long,
                               device=logits.device)
            counts = token_counts(new, logits.shape[-1])[0]
            logits = apply_penalties(logits, counts, p.presence_penalty, p.frequency_penalty)
        if self.bias is not None:
            logits = apply_logit_bias(logits, self.bias.to(logits.device))
        if self.state is not None:
            # A complete value allows the end ids only: the request then ends with one.
            logits = logits.masked_fill(~self.state.allowed().to(logits.device), -math.inf)
        return logits

    def advance(self, token: int) -> None:
        """The request took ``token``: its grammar state moves on."""
        if self.state is not None and not self.state.done:
            self.state.advance(token)

    def token_logprobs(self, raw: Tensor, token: int) -> TokenLogprobs | None:
        """The chosen ``token``'s entry from the row's raw logits ``V`` (``None`` when the
        request asks for no logprobs)."""
        k = self.params.logprobs
        if k is None:
            return None
        chosen, ids, values = step_logprobs(raw[None], torch.tensor([token]), k)
        return TokenLogprobs(float(chosen[0]), tuple(ids[0].tolist()),
                             tuple(values[0].tolist()))

    @property
    def wants_prompt(self) -> bool:
        """Whether a prefill chunk's every hidden state is wanted (not yet reported)."""
        return self.params.prompt_logprobs and not self.prompt_taken

    def record_prompt(self, hidden: Tensor, start: int, tokens: Sequence[int],
                      lm_head: Callable[[Tensor], Tensor]) -> None:
        """Record the prompt entries that one prefill chunk predicts: ``hidden`` ``n x E``
        of the tokens at ``start .. start + n - 1``, whose position ``j`` predicts token
        ``j + 1`` (kept while that is a prompt token); ``lm_head``: hidden -> logits."""
        n = min(hidden.shape[0], self.prompt_length - 1 - start)
        if n <= 0:
            return
        targets = torch.tensor(tokens[start + 1:start + 1 + n])
        chosen, ids, values = step_logprobs(lm_head(hidden[:n]), targets,
                                            self.params.logprobs)
        for j, (c, i, v) in enumerate(zip(chosen.tolist(), ids.tolist(), values.tolist())):
            self.prompt[start + 1 + j] = TokenLogprobs(c, tuple(i), tuple(v))

    def take_prompt(self) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's entries, once (the first token's event), the first without a
        value; ``None`` when not asked for."""
        if not self.wants_prompt:
            return None
        entries = (TokenLogprobs.none(),
                   *(self.prompt[i] for i in range(1, self.prompt_length)))
        self.prompt, self.prompt_taken = {}, True
        return entries


def process_rows(controls: Sequence[RequestLogits | None], tokens: Sequence[Sequence[int]],
                 logits: Tensor) -> Tensor:
    """Every request's processors on its row: logits ``R x V`` -> ``R x V``, the input itself
    when no row asks for any."""
    todo = [i for i, c in enumerate(controls) if c is not None and c.active]
    if not todo:
        return logits
    out = logits.clone()
    for i in todo:
        out[i] = controls[i].process(logits[i], tokens[i])
    return out
