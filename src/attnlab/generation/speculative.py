"""Speculative decoding: a proposer guesses ``n`` tokens, one forward of the model checks them.

A decoding step reads every weight to make one token; on a CPU that read is the whole cost.
Feeding the last token and ``n`` drafts ``d_1..d_n`` in one forward (``1 x (n + 1)``
positions, same weights read once) gives the model's next-token logits after each prefix:

    rows = model([last, d_1, .., d_n], cache)                              (n + 1) x V
    row i = the logits of the token after d_i (row 0: after the last token)

Greedy: ``d_i`` is accepted while it equals ``argmax(row i-1)``; the first row that disagrees
(or the last row, when all agree) gives one more token, the model's own. So the tokens are
exactly those of plain greedy decoding, and every pass yields ``1 .. n + 1`` of them.

Sampling (Leviathan et al. 2023; Chen et al. 2023): with ``p`` the target's filtered
distribution at a row and ``q`` the one the draft was drawn from, ``d ~ q`` is accepted with
probability ``min(1, p(d) / q(d))``; on a rejection the token is drawn from
``norm(max(0, p - q))``; after ``n`` acceptances one more is drawn from the last row's ``p``.
Then the token has probability ``q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))
max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q)(x) + max(0, p - q)(x) = p(x)``:
the target's distribution exactly (the course page, tutorial 12, derives it). A proposer
without a ``q`` (prompt lookup, a greedy draft) has a one-hot one.

The rejected positions' keys are rolled back with ``KVCache.truncate``. Batch 1 only, as in
transformers: rows would accept different numbers of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.generation.proposers import DraftModel, Draw, PromptLookup, Proposer, early_exit
from attnlab.generation.protocols import CausalLM, Streamer
from attnlab.generation.sampling import (
    apply_repetition_penalty,
    check_logits,
    greedy_tokens,
    sampling_probs,
)
from attnlab.generation.stopping import StopStrings

__all__ = ["Decoding", "SpeculativeStats", "accept_greedy", "accept_sampled", "make_proposer",
           "speculative_generate"]


@dataclass
class SpeculativeStats:
    """Counts of a speculative generation: verification ``passes`` (forwards after the
    prefill), draft tokens ``proposed`` and ``accepted``, ``new_tokens`` made."""

    passes: int = 0
    proposed: int = 0
    accepted: int = 0
    new_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed ones (0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per forward of the model after the prefill (the prefill makes one)."""
        return (self.new_tokens - 1) / self.passes if self.passes else 1.0


@dataclass(frozen=True)
class Decoding:
    """The rule ``generate`` decodes with, checked there: greedy or sampling (temperature,
    top-k, top-p), the repetition penalty, the end ids ``eos`` (1-d tensor or None), stop
    strings, and the sampling's generator."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    eos: Tensor | None = None
    stop: StopStrings | None = None
    generator: torch.Generator | None = None


def make_proposer(model: CausalLM, input_ids: Tensor, attention_mask: Tensor, capacity: int, *,
                  prompt_lookup_num_tokens: int | None, max_matching_ngram_size: int | None,
                  assistant_model: CausalLM | None, assistant_early_exit: int | None,
                  use_cache: bool) -> Proposer | None:
    """The proposer that ``generate``'s arguments ask for (at most one), None for none; the
    generation's shape is checked: one row, no padding, the KV cache on. ``capacity``: the
    positions a draft's cache needs (prompt + new tokens)."""
    asked = {name: value for name, value in (
        ("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
        ("assistant_model", assistant_model),
        ("assistant_early_exit", assistant_early_exit)) if value is not None}
    if max_matching_ngram_size is not None and prompt_lookup_num_tokens is None:
        raise ValueError(f"max_matching_ngram_size: only used with prompt_lookup_num_tokens, "
                         f"got {max_matching_ngram_size!r} without it")
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError(f"{', '.join(asked)}: expected one way of proposing tokens for "
                         f"speculative decoding, got {len(asked)}")
    name = next(iter(asked))
    if input_ids.shape[0] != 1:
        raise ValueError(f"{name}: speculative decoding takes a batch of 1 row (rows would "
                         f"accept different numbers of tokens), got {input_ids.shape[0]} rows")
    if not bool(attention_mask.all()):
        raise ValueError(f"attention_mask: speculative decoding ({name}) takes a prompt "
                         f"without padding, got {attention_mask.tolist()}")
    if not use_cache:
        raise ValueError(f"use_cache: speculative decoding ({name}) verifies drafts with the "
                         f"KV cache, got use_cache=False")
    if prompt_lookup_num_tokens is not None:
        return PromptLookup(prompt_lookup_num_tokens,
                            3 if max_matching_ngram_size is None else max_matching_ngram_size)
    draft = assistant_model if assistant_model is not None \
        else early_exit(model, assistant_early_exit)
    return DraftModel(draft, capacity, vocab_size=model.config.vocab_size)


@torch.no_grad()
def speculative_generate(model: CausalLM, input_ids: Tensor, proposer: Proposer,
                         max_new_tokens: int, decoding: Decoding, *,
                         streamer: Streamer | None = None,
                         stats: SpeculativeStats | None = None) -> Tensor:
    """Extend ``input_ids`` ``1 x P`` by up to ``max_new_tokens`` tokens, with drafts from
    ``proposer`` verified in one forward each (module docstring): ``1 x (P + n)``.

    The first token comes from the prefill, as in plain decoding; each later pass feeds the
    last token and up to ``max_new_tokens - made - 1`` drafts. A row ends at an end id, a
    stop string or ``max_new_tokens``, token by token, as ``generate`` ends it. ``stats``,
    if given, is filled in.
    """
    stats = SpeculativeStats() if stats is None else stats
    ids, P = input_ids, input_ids.shape[1]
    if max_new_tokens == 0:
        if streamer is not None:
            streamer.end()
        return ids
    cache = model.make_cache(1, P + max_new_tokens)
    expires = getattr(model, "cache_expires", lambda length: False)
    greedy = getattr(model, "greedy", greedy_tokens)
    draw = _drawer(decoding)
    rows = model(ids, attention_mask=_ones(P, ids), cache=cache, logits_to_keep=1)[0]
    drafts, q = ids[0, :0], None
    while True:
        tokens = _verify(rows, drafts, q, ids, decoding, greedy)
        cache.truncate(ids.shape[1] + tokens.shape[0] - 1)
        proposer.feedback(drafts.shape[0], tokens.shape[0] - 1)
        stats.proposed += drafts.shape[0]
        stats.accepted += tokens.shape[0] - 1
        ids, done = _append(ids, tokens, P, max_new_tokens, decoding, streamer)
        stats.new_tokens = ids.shape[1] - P
        if done:
            break
        stats.passes += 1
        T = ids.shape[1]
        if expires(cache.length):  # as generate: the whole sequence again, one token from it
            cache.reset()
            rows = model(ids, attention_mask=_ones(T, ids), cache=cache, logits_to_keep=1)[0]
            drafts, q = ids[0, :0], None
            continue
        k = max_new_tokens - (T - P) - 1  # room for the drafts and the token after them
        # A model whose keys go stale at some length sees every draft's length asked first.
        k = next((j - 1 for j in range(1, k + 1) if expires(cache.length + j)), k)
        drafts, q = proposer.propose(ids, k, draw) if k else (ids[0, :0], None)
        x = torch.cat([ids[:, -1:], drafts[None].to(ids.device)], dim=1)
        rows = model(x, attention_mask=_ones(T + drafts.shape[0], ids), cache=cache,
                     logits_to_keep=x.shape[1])[0]
    if streamer is not None:
        streamer.end()
    return ids


def accept_greedy(targets: Tensor, drafts: Tensor) -> int:
    """How many drafts ``n`` to keep: the longest prefix equal to the target's choices
    ``targets`` ``n + 1`` (target ``i`` follows draft ``i``'s prefix)."""
    n = drafts.shape[0]
    same = (targets[:n] == drafts).long()
    return int(same.cumprod(0).sum()) if n else 0


def accept_sampled(p: Tensor, q: Tensor | None, drafts: Tensor,
                   generator: torch.Generator | None = None) -> Tensor:
    """The rejection rule: target probabilities ``p`` ``(n + 1) x V``, the draft's ``q``
    ``n x V`` (None: one-hot on each draft), drafts ``n`` -> the kept drafts followed by one
    more token (``m + 1`` ids, ``m <= n``), distributed exactly as ``p`` (module docstring)."""
    n = drafts.shape[0]
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    for i in range(n):
        d = int(drafts[i])
        q_row = torch.zeros_like(p[i]).index_fill_(0, drafts[i:i + 1], 1.0) if q is None \
            else q[i].to(p.dtype)
        if u[i] * q_row[d] < p[i, d]:  # probability min(1, p(d) / q(d))
            continue
        residual = (p[i] - q_row).clamp(min=0)
        # Rejected means p(d) < q(d), so some p(x) > q(x); rounding could still zero it all.
        return torch.cat([drafts[:i], _draw(residual if residual.sum() > 0 else p[i],
                                            generator)])
    return torch.cat([drafts, _draw(p[n], generator)])


def _verify(rows: Tensor, drafts: Tensor, q: Tensor | None, ids: Tensor, decoding: Decoding,
            greedy: Callable[[Tensor], Tensor]) -> Tensor:
    """The tokens this pass yields: logits ``rows`` ``(n + 1) x V`` after ``ids`` and each
    draft prefix -> the kept drafts and the target's next token (``m + 1`` ids)."""
    n = drafts.shape[0]
    if decoding.repetition_penalty != 1.0:  # row i sees the sequence and drafts 1..i
        seen = torch.cat([ids, drafts[None].to(ids.device)], dim=1)
        rows = torch.cat([apply_repetition_penalty(rows[i:i + 1], seen[:, :ids.shape[1] + i],
                                                   decoding.repetition_penalty)
                          for i in range(n + 1)])
    step = ids.shape[1]
    if decoding.do_sample:
        check_logits(rows, f"logits (the model's output after {step} tokens)")
        p = sampling_probs(rows, decoding.temperature, decoding.top_k, decoding.top_p,
                           check=False)
        return accept_sampled(p, q, drafts.to(p.device), decoding.generator)
    targets = greedy(rows)
    m = accept_greedy(targets, drafts.to(targets.device))
    # The chosen entries are their rows' maxima: checking them checks the rows (generate's).
    check_logits(rows[:m + 1].gather(-1, targets[:m + 1, None]),
                 f"logits (the model's output after {step} tokens)")
    return torch.cat([drafts[:m].to(targets.device), targets[m:m + 1]])


def _append(ids: Tensor, tokens: Tensor, P: int, max_new_tokens: int, decoding: Decoding,
            streamer: Streamer | None) -> tuple[Tensor, bool]:
    """Add ``tokens`` one by one, as plain decoding would, up to the first that ends the row
    (an end id, a stop string, the length); returns the ids and whether the row ended."""
    for token in tokens.to(ids.device).unbind():
        token = token[None]
        ids = torch.cat([ids, token[None]], dim=1)
        done = ids.shape[1] - P == max_new_tokens
        if decoding.eos is not None and bool(torch.isin(token, decoding.eos)):
            done = True
        if decoding.stop is not None and bool(decoding.stop(ids[:, P:], torch.ones(
                1, dtype=torch.bool, device=ids.device))[0]):
            done = True
        if streamer is not None:
            streamer.put(token)
        if done:
            return ids, True
    return ids, False


def _drawer(decoding: Decoding) -> Draw:
    """The rule a model draft decodes with: the target's (greedy, or its filtered softmax)."""
    if not decoding.do_sample:
        return lambda logits: (greedy_tokens(logits), None)

    def draw(logits: Tensor) -> tuple[Tensor, Tensor]:
        check_logits(logits, "logits (the draft model's output)")
        q = sampling_probs(logits, decoding.temperature, decoding.top_k, decoding.top_p,
                           check=False)
        return _draw(q[0], decoding.generator), q

    return draw


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token from probabilities ``V`` (not necessarily normalised): ids ``1``."""
    return torch.multinomial(probs.float(), 1, generator=generator)


def _ones(length: int, like: Tensor) -> Tensor:
    """The attention mask of one unpadded row of ``length`` positions, on ``like``'s device."""
    return torch.ones(1, length, dtype=torch.long, device=like.device)

