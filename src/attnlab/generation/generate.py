"""Autoregressive generation for a decoder-only LM (``attnlab.models.DecoderLM``).

One prefill pass runs the whole (left-padded) prompt and fills the KV cache; each later
step feeds only the newest token, at position ``offset = cache.length``. Per step:

    logits = model(last_token, attention_mask, cache, logits_to_keep=1)[:, -1]    B x V
    logits = repetition_penalty(logits) -> token = argmax(logits)       (greedy)
                                        or token ~ softmax(filter(logits / T))  (sampling)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from attnlab.generation.sampling import (
    apply_repetition_penalty,
    check_sampling_args,
    sample_logits,
)

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

__all__ = ["Streamer", "generate"]


class Streamer(Protocol):
    """Receives tokens as they are made: ``put(ids B)`` once per step, ``end()`` at the end."""

    def put(self, token_ids: Tensor) -> None: ...

    def end(self) -> None: ...


@torch.no_grad()
def generate(
    model: DecoderLM,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
    streamer: Streamer | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Extend each prompt of ``input_ids`` (``B x P``) by up to ``max_new_tokens`` tokens.

    Returns ``B x (P + n)`` ids, the prompts followed by the new tokens, ``n <= max_new_tokens``
    (fewer when every row has produced ``eos_token_id``; a finished row is filled with
    ``pad_token_id``, which defaults to ``eos_token_id``).

    - ``attention_mask`` ``B x P`` (1/True = real token) for prompts of different lengths,
      which must be **left**-padded (padding first), so that every row's next token is last.
    - Greedy (``do_sample=False``) or sampling with ``temperature``, ``top_k``, ``top_p``
      (``attnlab.generation.sampling``); ``seed`` makes sampling reproducible.
    - ``repetition_penalty`` (CTRL) applies to every real token of the row so far.
    - ``streamer.put(ids B)`` is called with each new step's tokens, ``streamer.end()`` once.
    - ``use_cache=False`` recomputes the whole sequence at every step (same result, slower).

    Call ``model.eval()`` first for deterministic dropout-free output.
    """
    input_ids, attention_mask = _check_inputs(model, input_ids, max_new_tokens, attention_mask)
    check_sampling_args(temperature, top_k, top_p, repetition_penalty)
    if pad_token_id is None:
        pad_token_id = eos_token_id
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)

    B, P = input_ids.shape
    ids, mask = input_ids, attention_mask
    cache = model.make_cache(B, P + max_new_tokens) if use_cache and max_new_tokens else None
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    if max_new_tokens:
        logits = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]
    for step in range(max_new_tokens):
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, ids, repetition_penalty, mask)
        if do_sample:
            token = sample_logits(logits, temperature, top_k, top_p, generator)
        else:
            token = logits.argmax(dim=-1)
        if eos_token_id is not None:
            token = token.masked_fill(finished, pad_token_id)
            finished |= token == eos_token_id
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if streamer is not None:
            streamer.put(token)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        if cache is not None:
            logits = model(token[:, None], attention_mask=mask, cache=cache,
                               logits_to_keep=1)[:, -1]
        else:
            logits = model(ids, attention_mask=mask, logits_to_keep=1)[:, -1]
    if streamer is not None:
        streamer.end()
    return ids


def _check_inputs(model: DecoderLM, input_ids: Tensor, max_new_tokens: int,
                  attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2
            or input_ids.is_floating_point()):
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"input_ids: expected integer token ids of shape B x P, got {shape}")
    B, P = input_ids.shape
    if B == 0 or P == 0:
        raise ValueError(f"input_ids: expected a non-empty prompt (B >= 1, P >= 1), got shape "
                         f"{(B, P)}")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    max_len = model.config.max_len
    if P + max_new_tokens > max_len:
        raise ValueError(f"max_new_tokens: prompt length {P} + {max_new_tokens} new tokens "
                         f"exceeds the model's max_len={max_len}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != (B, P):
        raise ValueError(f"attention_mask: expected shape B x P = {(B, P)}, got "
                         f"{tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask: expected 0/1 (or bool) values")
    if bool((mask[:, -1] == 0).any()) or bool((mask.diff(dim=1) < 0).any()):
        raise ValueError("attention_mask: expected left padding (zeros before ones, a real "
                         f"token last in every row), got {mask.tolist()}")
    return input_ids, mask
