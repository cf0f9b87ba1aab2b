"""Proposers for speculative decoding: cheap guesses of the next tokens, checked by the model.

A proposer sees the sequence so far (``ids`` ``1 x T``) and returns up to ``k`` draft tokens
with the distribution ``q`` each was drawn from (``n x V``), or ``None`` when the guess is
deterministic (``q`` one-hot on the proposed token). ``attnlab.generation.speculative``
verifies them in one forward of the target model; whatever a proposer guesses, the output
is the target's (greedy: the same tokens; sampling: the same distribution).

- ``PromptLookup``: the longest recent n-gram of the sequence's end that occurred before
  proposes the tokens that followed it (Saxena's prompt lookup decoding; free to compute,
  strong on text that repeats its input: summaries, edits, code).
- ``DraftModel``: a smaller model sharing the tokenizer runs ``k`` cheap decoding steps
  (Leviathan et al. 2023; Chen et al. 2023). ``early_exit(model, N)`` makes such a draft out
  of the model's own first ``N`` layers, its final norm and its output head (LayerSkip,
  Elhoushi et al. 2024): no second model, the weights shared.

Model drafts adapt ``k`` to the acceptance rate as transformers' "heuristic" schedule does:
``k + 2`` after a pass that accepted every draft, ``k - 1`` (at least 1) otherwise; prompt
lookup, whose guesses cost nothing, also switches itself off and on (``PromptLookup``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from attnlab._checks import check_positive
from attnlab.generation.protocols import CausalLM, CausalLMConfig

__all__ = ["DraftModel", "Draw", "PromptLookup", "Proposer", "early_exit", "parse_speculative"]

# draw(logits 1 x V) -> (token 1, q 1 x V or None): the decoding rule a model draft follows
# (greedy: argmax and None; sampling: a token drawn from q, the filtered softmax).
Draw = Callable[[Tensor], tuple[Tensor, Tensor | None]]


class Proposer(Protocol):
    """``propose(ids 1 x T, k, draw) -> (tokens n, q n x V or None)``, ``n <= k``;
    ``feedback(proposed, accepted)`` after each verification (a proposer may adapt ``k``)."""

    def propose(self, ids: Tensor, k: int, draw: Draw) -> tuple[Tensor, Tensor | None]: ...

    def feedback(self, proposed: int, accepted: int) -> None: ...


class PromptLookup:
    """Propose the ``num_tokens`` tokens that followed the most recent earlier occurrence of
    the sequence's last ``n`` tokens, for the largest ``n <= max_ngram`` that occurs earlier
    (the earliest occurrence when no recent one is followed by ``num_tokens`` tokens).

    ``ids`` ``... a b c [x y z] ... a b c`` with ``n = 3`` proposes ``x y z``. Nothing is
    proposed when no n-gram matches (the step is then a plain decoding step). ``q`` is
    one-hot: the guess is a function of the sequence.

    Verifying ``k`` drafts costs more than one token's step once the arithmetic, not the
    weights' read, bounds it (one thread, a small model), so the number proposed adapts:
    ``k + 2`` (up to ``num_tokens``) after a pass that accepted all, the number accepted
    after one that did not. At 0 the lookup is off: it goes on guessing for free, unverified,
    and turns on again (``k = 2``) when such a guess turns out to be the model's next token.
    On text that copies its input it stays on; on open-ended text it stays mostly off.
    """

    def __init__(self, num_tokens: int, max_ngram: int = 3) -> None:
        self.num_tokens = check_positive("prompt_lookup_num_tokens", num_tokens)
        self.max_ngram = check_positive("max_matching_ngram_size", max_ngram)
        self.k = num_tokens
        self.shadow: tuple[int, int] | None = None  # (position, token) guessed while off

    def propose(self, ids: Tensor, k: int, draw: Draw | None) -> tuple[Tensor, None]:
        seq = ids[0]
        T = seq.shape[0]
        if self.shadow is not None:
            position, token = self.shadow
            if position < T and int(seq[position]) == token:
                self.k = 2
            self.shadow = None
        guess = self.lookup(seq, min(k, self.num_tokens))
        if self.k == 0:
            if guess.numel():
                self.shadow = (T, int(guess[0]))
            return seq[:0], None
        return guess[:self.k], None

    def lookup(self, seq: Tensor, k: int) -> Tensor:
        """The guess itself: sequence ``T`` -> up to ``k`` tokens (none without a match)."""
        T = seq.shape[0]
        for n in range(min(self.max_ngram, T - 1), 0, -1):
            # Windows starting at 0 .. T-n-1: every occurrence that ends before the last token.
            windows = seq[:-1].unfold(0, n, 1)
            ends = ((windows == seq[T - n:]).all(dim=1).nonzero().flatten() + n).tolist()
            if ends:
                # The most recent one followed by k tokens; else the first (the longest tail:
                # in a loop "x y x y x y" the latest match is followed by one token only).
                start = next((e for e in reversed(ends) if e + k <= T), ends[0])
                return seq[start:start + k]
        return seq[:0]

    def feedback(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.k = min(self.k + 2, self.num_tokens) if accepted == proposed else accepted


class DraftModel:
    """A causal LM with the target's vocabulary proposes by decoding ``k`` tokens with its
    own KV cache (``capacity`` positions), following the target's rule (``draw``).

    Between calls the cache keeps the positions that still agree with the sequence (the
    accepted drafts) and drops the rest, so each call feeds only the new tokens. ``k``
    starts at ``num_tokens`` and adapts (module docstring) between 1 and ``max_tokens``.
    """

    def __init__(self, model: CausalLM, capacity: int, *, num_tokens: int = 5,
                 max_tokens: int = 16, vocab_size: int | None = None) -> None:
        if not isinstance(model, CausalLM) or not isinstance(model.config, CausalLMConfig):
            raise TypeError(f"assistant_model: expected a causal LM (attnlab.generation."
                            f"protocols.CausalLM), got {type(model).__name__}")
        if vocab_size is not None and model.config.vocab_size != vocab_size:
            raise ValueError(f"assistant_model: expected the target's vocabulary of "
                             f"{vocab_size} tokens (a draft shares the tokenizer), got "
                             f"vocab_size={model.config.vocab_size}")
        if capacity > model.config.max_len:
            raise ValueError(f"assistant_model: the generation needs {capacity} positions, "
                             f"more than the draft's limit of {model.config.max_len}")
        self.model = model
        self.k = check_positive("num_tokens", num_tokens)
        self.max_tokens = max(check_positive("max_tokens", max_tokens), num_tokens)
        self.cache = model.make_cache(1, capacity)
        self.cached: Tensor | None = None  # the tokens whose keys the cache holds

    @torch.no_grad()
    def propose(self, ids: Tensor, k: int, draw: Draw) -> tuple[Tensor, Tensor | None]:
        k = min(k, self.k)
        if k == 0:
            return ids[0, :0], None
        seq = ids[0]
        kept = 0
        if self.cached is not None:
            n = min(self.cached.shape[0], seq.shape[0])
            same = self.cached[:n] == seq[:n]
            kept = int(same.long().cumprod(0).sum())
        kept = min(kept, seq.shape[0] - 1)  # the last token is fed to get the next logits
        self.cache.truncate(kept)
        x = ids[:, kept:]
        tokens, qs = [], []
        for _ in range(k):
            mask = torch.ones(1, self.cache.length + x.shape[1], dtype=torch.long,
                              device=ids.device)
            logits = self.model(x, attention_mask=mask, cache=self.cache, logits_to_keep=1)
            token, q = draw(logits[:, -1])
            tokens.append(token)
            qs.append(q)
            x = token[:, None]
        drafts = torch.cat(tokens)
        self.cached = torch.cat([seq, drafts[:-1]])
        return drafts, None if qs[0] is None else torch.cat(qs)

    def feedback(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.k = min(self.k + 2, self.max_tokens) if accepted == proposed \
                else max(self.k - 1, 1)


def early_exit(model: CausalLM, num_layers: int) -> CausalLM:
    """The model cut after its first ``num_layers`` layers: the same embedding, the first
    blocks, the final norm and the output head, sharing every weight (LayerSkip's draft).

    The model must keep its blocks in a sliceable ``layers`` list and its sizes in a
    dataclass config with ``num_layers`` (``attnlab.models.DecoderLM`` does). The returned
    module is a shallow copy: it makes caches of ``num_layers`` layers and leaves the model
    as it was.
    """
    layers = getattr(model, "layers", None)
    config = getattr(model, "config", None)
    if not isinstance(layers, torch.nn.ModuleList) or not dataclasses.is_dataclass(config) \
            or not hasattr(config, "num_layers"):
        raise TypeError(f"assistant_early_exit: expected a model with a `layers` ModuleList "
                        f"and a dataclass config with num_layers (a DecoderLM), got "
                        f"{type(model).__name__}")
    check_positive("assistant_early_exit", num_layers)
    if num_layers >= len(layers):
        raise ValueError(f"assistant_early_exit: expected fewer layers than the model's "
                         f"{len(layers)}, got {num_layers}")
    view = copy.copy(model)
    # A new table of submodules (the copy shares the model's), holding the first blocks.
    view._modules = dict(model._modules)
    view._modules["layers"] = layers[:num_layers]
    view.config = dataclasses.replace(config, num_layers=num_layers)
    return view


def parse_speculative(text: str) -> tuple[str, int | str]:
    """A proposer named as on the command line: ``ngram`` (prompt lookup of 10 tokens, as
    transformers' examples use), ``ngram:K``, ``self:N`` (the first ``N`` layers) or
    ``draft:DIR`` (a draft model's folder) -> ``(kind, K or N or DIR)``."""
    kind, _, value = text.partition(":")
    if kind == "ngram" and not value:
        return "ngram", 10
    if kind in ("ngram", "self"):
        count = int(value) if value.isdigit() else 0
        if count >= 1:
            return kind, count
        letter = "K" if kind == "ngram" else "N"
        raise ValueError(f"expected {kind}:{letter} with an int {letter} >= 1, got {text!r}")
    if kind == "draft" and value:
        return "draft", value
    raise ValueError(f"expected ngram, ngram:K, self:N or draft:DIR, got {text!r}")
