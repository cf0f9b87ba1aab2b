"""Token log-probabilities, as OpenAI's APIs report them.

The values are the model's own distribution, before any sampling processor (penalty, bias,
temperature, top-k/p, min-p, grammar): ``log_softmax(logits)`` in float32 or wider, for the
chosen token and the ``k`` most likely ones. Two steps:

1. ``step_logprobs(logits B x V, tokens B, k)``: the tensors, once a decoding step
   (``prompt_logprobs`` does the same for every position of a prompt; its first token has no
   context, so no value: NaN here, ``null`` in OpenAI's answers).
2. ``token_entries(ids, logprobs, top_ids, top_logprobs, decoder)``: one ``TokenEntry`` per
   token (its text, bytes, offset in the text, alternatives), from which both of OpenAI's
   forms are built: ``completions_logprobs`` (``tokens``, ``token_logprobs``,
   ``top_logprobs``, ``text_offset``) and ``chat_logprobs`` (``content: [{token, logprob,
   bytes, top_logprobs}]``).

A token's bytes come from ``decoder.token_bytes(id)`` when the decoder has it
(``attnlab.tokenizer.Tokenizer``: exact, also for a byte-level token that holds part of a
character), else from the UTF-8 of ``decoder.decode([id])``. Its text is those bytes as UTF-8;
a token that is not whole UTF-8 is written ``bytes:\\xe2\\x80`` (OpenAI's and vLLM's form).
``text_offset`` counts characters of the decoded text up to the token (``len(decode(ids[:i]))``),
starting from ``start_offset``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab._checks import is_int
from attnlab.generation.stopping import Decoder

__all__ = [
    "MAX_TOP_LOGPROBS",
    "TokenEntry",
    "chat_logprobs",
    "check_top_logprobs",
    "completions_logprobs",
    "prompt_logprobs",
    "step_logprobs",
    "token_entries",
]

# OpenAI's chat API allows top_logprobs up to 20 (its completions API up to 5).
MAX_TOP_LOGPROBS = 20


def step_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``log_softmax(logits)`` of the chosen tokens and the ``k`` most likely ones.

    logits ``B x V`` (the model's raw output), tokens ``B`` -> ``(logprob B, top_ids B x k,
    top_logprobs B x k)``, float32 or wider, the alternatives most likely first.
    """
    check_top_logprobs(k)
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = lp.gather(-1, tokens.long()[..., None])[..., 0]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return chosen, top.indices, top.values


def prompt_logprobs(logits: Tensor, input_ids: Tensor, k: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """``step_logprobs`` for every prompt token from the logits of the whole prompt.

    logits ``B x P x V`` (position ``i`` predicts token ``i + 1``), input_ids ``B x P`` ->
    ``(logprob B x P, top_ids B x P x k, top_logprobs B x P x k)``; position 0 has no
    prediction: NaN and id -1.
    """
    B, P, V = logits.shape
    chosen, ids, values = step_logprobs(logits[:, :-1].reshape(-1, V),
                                        input_ids[:, 1:].reshape(-1), k)
    first = torch.full((B, 1), math.nan, dtype=chosen.dtype)
    return (torch.cat([first, chosen.view(B, P - 1)], dim=1),
            torch.cat([torch.full((B, 1, ids.shape[-1]), -1), ids.view(B, P - 1, -1)], dim=1),
            torch.cat([first[..., None].expand(B, 1, values.shape[-1]),
                       values.view(B, P - 1, -1)], dim=1))


@dataclass(frozen=True)
class TokenEntry:
    """One token as OpenAI reports it: ``token`` (text, or ``bytes:\\x..`` when not whole
    UTF-8), ``bytes`` (its UTF-8 bytes as ints), ``logprob`` (``None``: the prompt's first
    token), ``text_offset`` (characters before it), ``top`` (the alternatives: ``(token,
    bytes, logprob)``, most likely first)."""

    token: str
    bytes: list[int]
    logprob: float | None
    text_offset: int
    top: list[tuple[str, list[int], float]]


def token_entries(ids: Sequence[int], logprobs: Sequence[float], top_ids: Sequence[Sequence[int]],
                  top_logprobs: Sequence[Sequence[float]], decoder: Decoder, *,
                  start_offset: int = 0, context: Sequence[int] = ()) -> list[TokenEntry]:
    """One ``TokenEntry`` per token of ``ids`` (one row: ``step_logprobs``' or
    ``prompt_logprobs``' values as lists; NaN = no value, ``None`` in the entry; an id of -1
    among the alternatives is skipped). ``context``: the ids before these (the prompt), which
    the offsets decode with (a SentencePiece decoder reads a first token differently);
    ``start_offset`` is added to every offset."""
    ids = list(ids)
    base = len(decoder.decode(list(context))) if context else 0
    texts = {}
    entries = []
    for i, token in enumerate(ids):
        offset = start_offset + len(decoder.decode([*context, *ids[:i]])) - base
        top = []
        for alt, value in zip(top_ids[i], top_logprobs[i]):
            if alt < 0 or math.isnan(value):
                continue
            if alt not in texts:
                texts[alt] = _token_text(decoder, alt)
            top.append((*texts[alt], float(value)))
        if token not in texts:
            texts[token] = _token_text(decoder, token)
        value = float(logprobs[i])
        entries.append(TokenEntry(*texts[token], None if math.isnan(value) else value, offset,
                                  top))
    return entries


def completions_logprobs(entries: Sequence[TokenEntry]) -> dict:
    """OpenAI's completions form: ``{tokens, token_logprobs, top_logprobs, text_offset}``;
    ``top_logprobs`` is a ``{token: logprob}`` per token (``None`` where there is no value,
    as for the prompt's first token). Alternatives with the same text keep the first (most
    likely) value, as a JSON object can hold a key once."""
    tops = []
    for e in entries:
        if e.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token, _, value in e.top:
            top.setdefault(token, value)
        tops.append(top)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.text_offset for e in entries]}


def chat_logprobs(entries: Sequence[TokenEntry]) -> dict:
    """OpenAI's chat form: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}]}``."""
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
         "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in e.top]}
        for e in entries]}


def check_top_logprobs(k: object, *, name: str = "logprobs",
                       limit: int = MAX_TOP_LOGPROBS) -> int:
    """``k`` when it is an int in ``[0, limit]``; else a ``ValueError`` naming ``name``."""
    if not is_int(k) or not 0 <= k <= limit:
        raise ValueError(f"{name}: expected an int in [0, {limit}] (the alternatives per "
                         f"token), got {k!r}")
    return k


def _token_text(decoder: Decoder, token: int) -> tuple[str, list[int]]:
    """``(text, bytes)`` of one token (module docstring)."""
    raw = getattr(decoder, "token_bytes", None)
    data = raw(token) if raw is not None else decoder.decode([token]).encode("utf-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return text, list(data)
