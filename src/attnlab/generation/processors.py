"""Logits processors that OpenAI-style requests ask for: presence and frequency penalties,
a logit bias, min-p. Pure functions, each applied per row, so that one batch can hold
requests with different settings (a value per row, or one for all rows).

Each takes logits ``B x V`` (or ``V``, one row) and returns a new tensor; none changes its
input. Shapes: ``counts`` ``B x V`` (how often each token appears in a row's generated text,
``token_counts``), per-row values a number or a sequence / 1-d tensor of ``B`` numbers.

- OpenAI's penalties: ``logit_j - counts_j * frequency - [counts_j > 0] * presence``,
  both in ``[-2, 2]`` (OpenAI's range; negative values favour repeats).
- logit bias: ``logit_j + bias_j`` for the listed token ids, each bias in ``[-100, 100]``
  (OpenAI's range: -100 all but bans a token, 100 all but forces it).
- min-p (Nguyen et al., 2024): with ``p = softmax(logits)``, drop (``-inf``) every token whose
  probability is below ``min_p * max_j p_j``; the most likely token is always kept. As in
  transformers, it runs after the temperature (``sampling.sampling_probs``).

CTRL's repetition penalty lives with the other sampling filters
(``sampling.apply_repetition_penalty``) and takes a value per row too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from attnlab._checks import is_int, is_number

__all__ = [
    "FREQUENCY_RANGE",
    "LOGIT_BIAS_RANGE",
    "apply_logit_bias",
    "apply_penalties",
    "check_logit_bias",
    "logit_bias_tensor",
    "min_p_filter",
    "per_row",
    "token_counts",
]

# OpenAI's ranges for presence_penalty / frequency_penalty, and for a logit_bias value.
FREQUENCY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def apply_penalties(logits: Tensor, counts: Tensor, presence_penalty: float | Sequence[float]
                    | Tensor = 0.0, frequency_penalty: float | Sequence[float] | Tensor = 0.0
                    ) -> Tensor:
    """OpenAI's presence and frequency penalties:
    ``logits - counts * frequency_penalty - (counts > 0) * presence_penalty``.

    logits ``B x V`` (or ``V``), counts ``B x V`` (or ``V``, ``token_counts``) -> ``B x V``.
    Each penalty is one number in ``[-2, 2]`` or one per row.
    """
    rows = _rows(logits)
    presence = per_row("presence_penalty", presence_penalty, rows.shape[0], FREQUENCY_RANGE)
    frequency = per_row("frequency_penalty", frequency_penalty, rows.shape[0], FREQUENCY_RANGE)
    counts_rows = counts.reshape(rows.shape) if counts.shape == logits.shape else None
    if counts_rows is None:
        raise ValueError(f"counts: expected the logits' shape {tuple(logits.shape)} (B x V), "
                         f"got {tuple(counts.shape)}")
    c = counts_rows.to(rows.dtype)
    out = rows - c * frequency.to(rows) - (c > 0).to(rows.dtype) * presence.to(rows)
    return out.reshape(logits.shape)


def token_counts(token_ids: Tensor, vocab_size: int, token_mask: Tensor | None = None
                 ) -> Tensor:
    """How often each token occurs in each row: token_ids ``B x T`` -> counts ``B x V``
    (float32), counting only where ``token_mask`` ``B x T`` (if given) is True."""
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids: expected shape B x T, got {tuple(token_ids.shape)}")
    weight = torch.ones(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    if token_mask is not None:
        weight = weight * token_mask.float()
    counts = torch.zeros(token_ids.shape[0], vocab_size, dtype=torch.float32,
                         device=token_ids.device)
    return counts.scatter_add_(-1, token_ids.long(), weight)


def apply_logit_bias(logits: Tensor, bias: Tensor) -> Tensor:
    """``logits + bias``: bias ``B x V`` or ``V`` (``logit_bias_tensor``; zero where a row sets
    no bias) -> ``B x V``. Kept as a function so that the order of processors reads in one
    place (``generate``)."""
    if bias.shape[-1] != logits.shape[-1]:
        raise ValueError(f"bias: expected a last dimension of V = {logits.shape[-1]}, got "
                         f"shape {tuple(bias.shape)}")
    return logits + bias.to(logits.dtype)


def logit_bias_tensor(logit_bias: Mapping[int, float] | Sequence[Mapping[int, float] | None],
                      batch_size: int, vocab_size: int, *, name: str = "logit_bias"
                      ) -> Tensor:
    """OpenAI's ``logit_bias`` (token id -> bias in ``[-100, 100]``; JSON's string keys
    ``"50256"`` are read as ids), one mapping for all rows or one per row (``None``: no
    bias), as a dense ``B x V`` float32 tensor for ``apply_logit_bias``."""
    if isinstance(logit_bias, Mapping):
        per = [logit_bias] * batch_size
    elif isinstance(logit_bias, Sequence) and not isinstance(logit_bias, str) \
            and len(logit_bias) == batch_size:
        per = list(logit_bias)
    else:
        raise ValueError(f"{name}: expected a mapping of token id -> bias, or a list of "
                         f"{batch_size} of them (one per row), got {logit_bias!r}")
    out = torch.zeros(batch_size, vocab_size, dtype=torch.float32)
    for row, mapping in enumerate(per):
        if mapping is None:
            continue
        where = name if isinstance(logit_bias, Mapping) else f"{name}[{row}]"
        for token, value in check_logit_bias(mapping, vocab_size, name=where).items():
            out[row, token] = value
    return out


def check_logit_bias(logit_bias: object, vocab_size: int, *, name: str = "logit_bias"
                     ) -> dict[int, float]:
    """``logit_bias`` as ``{id: bias}`` when every key is a token id in ``[0, V)`` (an int or
    its decimal string, as JSON writes keys) and every value a number in ``[-100, 100]``;
    else a ``ValueError`` naming the entry and the range."""
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"{name}: expected a mapping of token id -> bias, got "
                         f"{type(logit_bias).__name__}")
    out: dict[int, float] = {}
    lo, hi = LOGIT_BIAS_RANGE
    for key, value in logit_bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"{name}: expected token ids in [0, {vocab_size}) (the model's "
                             f"vocabulary) as keys, got {key!r}")
        if not is_number(value, finite=True) or not lo <= value <= hi:
            raise ValueError(f"{name}[{key!r}]: expected a bias in [{lo:g}, {hi:g}], got "
                             f"{value!r}")
        out[token] = float(value)
    return out


def min_p_filter(logits: Tensor, min_p: float | Sequence[float] | Tensor) -> Tensor:
    """Keep the tokens whose probability is at least ``min_p`` times the row's largest, set
    the others to ``-inf``: logits ``B x V`` (or ``V``) -> same shape. ``min_p`` in ``[0, 1]``
    (0 keeps all), one number or one per row; the most likely token is always kept.

    In log space: keep ``logit_j >= max_i logit_i + log(min_p)``, the same set as transformers'
    ``MinPLogitsWarper`` without a softmax.
    """
    rows = _rows(logits)
    p = per_row("min_p", min_p, rows.shape[0], (0.0, 1.0))
    wide = rows.to(torch.promote_types(rows.dtype, torch.float32))
    probs = torch.softmax(wide, dim=-1)
    threshold = p.to(probs) * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(-1, wide.argmax(dim=-1, keepdim=True), False)
    return rows.masked_fill(remove, float("-inf")).reshape(logits.shape)


def per_row(name: str, value: float | Sequence[float] | Tensor, batch_size: int,
            bounds: tuple[float, float], expected: str | None = None) -> Tensor:
    """One value per row as a float64 ``B x 1`` tensor (to broadcast over ``V``), each in
    ``[lo, hi]``; a single number serves every row. Errors name ``name`` and the range
    (``expected`` words it instead, e.g. "a number > 0")."""
    lo, hi = bounds
    expected = expected or f"a number in [{lo:g}, {hi:g}]"
    if isinstance(value, Tensor):
        values = value.detach().flatten().tolist() if value.dim() <= 1 else None
    elif is_number(value):
        values = [value] * batch_size
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
    else:
        values = None
    if values is None or len(values) != batch_size:
        raise ValueError(f"{name}: expected {expected} or {batch_size} of them (one per "
                         f"row), got {value!r}")
    for v in values:
        if not is_number(v, finite=True) or not lo <= v <= hi:
            raise ValueError(f"{name}: expected {expected}, got {v!r}")
    return torch.tensor(values, dtype=torch.float64)[:, None]


def _rows(logits: Tensor) -> Tensor:
    """logits ``V`` or ``B x V`` as ``B x V`` (a view)."""
    if not isinstance(logits, Tensor) or logits.dim() not in (1, 2) \
            or not logits.is_floating_point():
        got = (f"{logits.dtype} of shape {tuple(logits.shape)}" if isinstance(logits, Tensor)
               else type(logits).__name__)
        raise ValueError(f"logits: expected a floating-point tensor V or B x V, got {got}")
    return logits.reshape(-1, logits.shape[-1])
