"""Greedy and beam-search decoding for an encoder-decoder (any ``protocols.Seq2SeqLM``, e.g.
``attnlab.models.Transformer``, whose ``generate`` method calls this).

The source is encoded once; each step runs the decoder on the newest token only, with the
decoder self-attention's keys/values in a ``KVCache`` and cross-attention over the memory.

A hypothesis ``y_1 .. y_n`` (generated tokens, ending with ``eos`` unless cut at
``max_new_tokens``) scores ``sum_t log p(y_t | y_<t, src) / n ** length_penalty``;
``length_penalty > 0`` favours longer outputs, ``0`` compares raw log-probabilities.

Beam search (as in Hugging Face): keep the ``K = num_beams`` best unfinished prefixes; at
each step take the ``2K`` best one-token extensions, move those that end in ``eos`` (and
rank among the first ``K``) to the finished list, keep the best ``K`` others. A row is
done when ``K`` hypotheses have finished and either ``early_stopping`` is true or the best
running prefix, scored at the current length, cannot beat the worst finished one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._checks import check_positive, check_token_ids, is_int, is_number
from attnlab.generation.protocols import Seq2SeqLM, Seq2SeqLMConfig
from attnlab.generation.sampling import check_logits

__all__ = ["beam_search", "generate_seq2seq", "greedy_search"]


def generate_seq2seq(model: Seq2SeqLM, src: Tensor, max_new_tokens: int, *, bos_id: int,
                     eos_id: int, num_beams: int = 1, length_penalty: float = 1.0,
                     early_stopping: bool = False, src_mask: Tensor | None = None,
                     pad_id: int | None = None, return_scores: bool = False,
                     num_return_sequences: int = 1) -> Tensor | tuple[Tensor, Tensor]:
    """Translate ``src`` (``B x S`` ids): greedy for ``num_beams=1``, else beam search.

    Returns ids ``B x (1 + n)`` starting with ``bos_id`` (rows that end early are filled with
    ``pad_id``, default the model's ``pad_id`` or else ``eos_id``), and with
    ``return_scores`` also the scores ``B`` (formula in the module docstring).
    ``src_mask`` ``B x S``: True = real token (default ``src != pad_id``).
    ``num_return_sequences`` ``R <= num_beams``: the ``R`` best hypotheses of each source,
    best first, as rows ``b * R .. b * R + R - 1`` (``B * R`` rows, as in Hugging Face).
    """
    if num_beams == 1 and num_return_sequences == 1:
        return greedy_search(model, src, max_new_tokens, bos_id=bos_id, eos_id=eos_id,
                             length_penalty=length_penalty, src_mask=src_mask, pad_id=pad_id,
                             return_scores=return_scores)
    return beam_search(model, src, max_new_tokens, bos_id=bos_id, eos_id=eos_id,
                       num_beams=num_beams, length_penalty=length_penalty,
                       early_stopping=early_stopping, src_mask=src_mask, pad_id=pad_id,
                       return_scores=return_scores, num_return_sequences=num_return_sequences)


@torch.no_grad()
def greedy_search(model: Seq2SeqLM, src: Tensor, max_new_tokens: int, *, bos_id: int,
                  eos_id: int, length_penalty: float = 1.0, src_mask: Tensor | None = None,
                  pad_id: int | None = None,
                  return_scores: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The most likely next token at every step (see ``generate_seq2seq`` for the arguments)."""
    memory, memory_mask, pad = _prepare(model, src, max_new_tokens, bos_id, eos_id, src_mask,
                                        pad_id, length_penalty)
    B = src.shape[0]
    cache = model.make_cache(B, max_new_tokens + 1)
    ys = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
    total = torch.zeros(B, device=src.device)
    lengths = torch.zeros(B, device=src.device)
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)
    for step in range(max_new_tokens):
        logits = model.decode(ys[:, -1:], memory, memory_mask, cache=cache)[:, -1]
        check_logits(logits, f"logits (the model's output for new token {step + 1})")
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = logp.argmax(dim=-1).masked_fill(finished, pad)
        total += logp.gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0)
        lengths += (~finished).float()
        finished |= token == eos_id
        ys = torch.cat([ys, token[:, None]], dim=1)
        if bool(finished.all()):
            break
    scores = total / lengths.clamp(min=1) ** length_penalty
    return (ys, scores) if return_scores else ys


@torch.no_grad()
def beam_search(model: Seq2SeqLM, src: Tensor, max_new_tokens: int, *, bos_id: int,
                eos_id: int, num_beams: int = 4, length_penalty: float = 1.0,
                early_stopping: bool = False, src_mask: Tensor | None = None,
                pad_id: int | None = None, return_scores: bool = False,
                num_return_sequences: int = 1) -> Tensor | tuple[Tensor, Tensor]:
    """Beam search with ``num_beams`` beams (see the module docstring and ``generate_seq2seq``,
    which also says what ``num_return_sequences`` returns). A source with fewer finished
    hypotheses than asked for (a tiny vocabulary) gets ``pad_id`` rows scored ``-inf``."""
    check_positive("num_beams", num_beams)
    if not is_int(num_return_sequences) or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences: expected an int in [1, num_beams={num_beams}], "
                         f"got {num_return_sequences!r}")
    memory, memory_mask, pad = _prepare(model, src, max_new_tokens, bos_id, eos_id, src_mask,
                                        pad_id, length_penalty)
    B, K, device = src.shape[0], num_beams, src.device
    memory = memory.repeat_interleave(K, dim=0)  # row b*K + i is beam i of source b
    if memory_mask is not None:
        memory_mask = memory_mask.repeat_interleave(K, dim=0)
    cache = model.make_cache(B * K, max_new_tokens + 1)
    seqs = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)
    beam_scores = torch.zeros(B, K, device=device)
    beam_scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        logits = model.decode(seqs[:, -1:], memory, memory_mask, cache=cache)[:, -1]
        check_logits(logits, f"logits (the model's output for new token {step + 1})")
        logp = torch.log_softmax(logits.float(), dim=-1)
        V = logp.shape[-1]
        candidates = (beam_scores.view(-1, 1) + logp).view(B, K * V)
        top_scores, top_index = candidates.topk(min(2 * K, K * V), dim=1)
        next_scores = torch.full((B, K), float("-inf"), device=device)
        next_tokens = torch.full((B, K), pad, dtype=torch.long, device=device)
        next_beams = torch.arange(K, device=device).repeat(B, 1)
        length = step + 1
        for b in range(B):
            if done[b]:
                continue
            kept = 0
            for rank, (score, index) in enumerate(zip(top_scores[b].tolist(),
                                                      top_index[b].tolist(), strict=True)):
                if score == float("-inf"):
                    break
                beam, token = divmod(index, V)
                if token == eos_id:
                    if rank < K:
                        tokens = [*seqs[b * K + beam, 1:].tolist(), eos_id]
                        _add(finished[b], K, score / length**length_penalty, tokens)
                    continue
                next_scores[b, kept], next_tokens[b, kept] = score, token
                next_beams[b, kept] = beam
                kept += 1
                if kept == K:
                    break
            best_running = float(next_scores[b].max())
            done[b] = _is_done(finished[b], K, best_running / length**length_penalty,
                               early_stopping)
        if all(done):
            break
        rows = (torch.arange(B, device=device)[:, None] * K + next_beams).view(-1)
        seqs = torch.cat([seqs[rows], next_tokens.view(-1, 1)], dim=1)
        beam_scores = next_scores
        cache.reorder(rows)
    else:
        # Out of steps: the running beams compete with the finished hypotheses.
        length = max(1, seqs.shape[1] - 1)
        for b in range(B):
            for i in range(K):
                score = float(beam_scores[b, i])
                if not done[b] and score != float("-inf"):
                    _add(finished[b], K, score / length**length_penalty,
                         seqs[b * K + i, 1:].tolist())
    R = num_return_sequences
    missing = (float("-inf"), [])
    best = [hyp for hyps in finished for hyp in [*hyps[:R], *[missing] * (R - len(hyps))]]
    n = max(len(tokens) for _, tokens in best)
    ids = torch.full((B * R, 1 + n), pad, dtype=torch.long, device=device)
    ids[:, 0] = bos_id
    for row, (_, tokens) in enumerate(best):
        ids[row, 1:1 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    scores = torch.tensor([score for score, _ in best], device=device)
    return (ids, scores) if return_scores else ids


def _add(hyps: list[tuple[float, list[int]]], K: int, score: float, tokens: list[int]) -> None:
    """Insert a finished hypothesis, keeping the ``K`` best, best first."""
    hyps.append((score, tokens))
    hyps.sort(key=lambda h: -h[0])
    del hyps[K:]


def _is_done(hyps: list[tuple[float, list[int]]], K: int, best_running: float,
             early_stopping: bool) -> bool:
    if best_running == float("-inf"):
        return True  # nothing left running
    if len(hyps) < K:
        return False
    return early_stopping or hyps[-1][0] >= best_running


def _prepare(model: Seq2SeqLM, src: Tensor, max_new_tokens: int, bos_id: int, eos_id: int,
             src_mask: Tensor | None, pad_id: int | None,
             length_penalty: float) -> tuple[Tensor, Tensor | None, int]:
    """Check the arguments, encode once: memory ``B x S x E``, key mask ``B x S``, pad id."""
    if not isinstance(model, Seq2SeqLM) or not isinstance(model.config, Seq2SeqLMConfig):
        raise TypeError(f"model: expected an encoder-decoder (source_mask, encode, decode, "
                        f"make_cache and a config with src_vocab_size, tgt_vocab_size, max_len, "
                        f"pad_id: attnlab.generation.protocols.Seq2SeqLM), got "
                        f"{type(model).__name__}")
    c = model.config
    if (not is_int(max_new_tokens)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if 1 + max_new_tokens > c.max_len:
        raise ValueError(f"max_new_tokens: bos + {max_new_tokens} new tokens exceed the model's "
                         f"max_len={c.max_len}")
    if not is_number(length_penalty, finite=True):  # NaN or inf would make every score equal
        raise ValueError(f"length_penalty: expected a finite float, got {length_penalty!r}")
    pad = c.pad_id if pad_id is None else pad_id
    pad = eos_id if pad is None else pad
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad)):
        if (not is_int(value)
                or not 0 <= value < c.tgt_vocab_size):
            raise ValueError(f"{name}: expected an id in [0, {c.tgt_vocab_size}), got {value!r}")
    check_token_ids("src", src, c.src_vocab_size)
    memory_mask = model.source_mask(src, src_mask)
    memory = model.encode(src, memory_mask)
    return memory, memory_mask, pad
