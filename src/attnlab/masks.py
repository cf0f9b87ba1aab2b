"""Attention masks, with one convention: a boolean mask is True where a query **may attend**.

A float attention mask is additive: 0 where a query may attend, ``-inf`` where it may not
(other finite values are biases, such as ALiBi); only the arguments documented as additive
(``mask`` of ``scaled_dot_product_attention`` and of the attention modules) read floats that
way. Every mask broadcasts against ``N.. x L x S`` (queries along ``L``, keys along ``S``).

A *key mask* (``key_mask`` of every layer, :func:`padding_mask`, Hugging Face's
``attention_mask``) says which keys are real: bool, or 0/1 integers or floats, with True / 1 =
may attend (:func:`key_mask_to_bool`). Anything else (a float key mask holding ``-inf``, 0.5 or
2) is ambiguous and refused.

The causal mask is aligned bottom-right: query ``i`` of ``L`` sees keys ``0 .. S - L + i``,
so the last query sees every key. With a KV cache (``S > L``) that is the right alignment;
for ``L == S`` it is the usual lower triangle.

Converters at the edges:

- PyTorch's ``key_padding_mask`` and boolean ``attn_mask`` of ``nn.MultiheadAttention`` mean
  True = **ignore**: :func:`from_key_padding_mask` negates them.
- Hugging Face's ``attention_mask`` is 1 for a real token, 0 for padding:
  :func:`from_hf_attention_mask` turns it into a boolean ``B x S`` key mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._checks import check_positive, is_int

__all__ = [
    "causal_mask",
    "combine_masks",
    "decoder_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "key_mask_to_attention_mask",
    "key_mask_to_bool",
    "padding_mask",
    "sliding_window_mask",
    "to_additive",
    "to_bool",
]


def causal_mask(
    L: int, S: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Bottom-right causal mask: ``mask[i, j] = j <= i + (S - L)``.

    Returns a boolean ``L x S`` tensor (True = may attend). ``S`` defaults to ``L``.
    """
    S = L if S is None else S
    _check_length("L", L)
    _check_length("S", S)
    rows = torch.arange(L, device=device).unsqueeze(-1)
    cols = torch.arange(S, device=device)
    return cols <= rows + (S - L)


def sliding_window_mask(
    L: int,
    S: int | None = None,
    window: int = 1,
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention: each query sees the ``window`` nearest key positions.

    With query ``i`` placed at key position ``p = i + S - L`` (bottom-right, as the causal
    mask), causal: ``p - window < j <= p`` (``window`` keys including itself);
    two-sided: ``|j - p| < window``. Returns a boolean ``L x S`` tensor.
    """
    S = L if S is None else S
    _check_length("L", L)
    _check_length("S", S)
    check_positive("window", window)
    pos = torch.arange(L, device=device).unsqueeze(-1) + (S - L)
    cols = torch.arange(S, device=device)
    if causal:
        return (cols <= pos) & (cols > pos - window)
    return (cols - pos).abs() < window


def decoder_mask(key_mask: Tensor | None, L: int, offset: int, window: int | None = None, *,
                 device: torch.device | str | None = None) -> Tensor | None:
    """A causal decoder's mask for ``L`` queries after ``offset`` cached positions (``S =
    offset + L`` keys): real keys only (``key_mask`` ``B x S`` bool, or None for no padding),
    bottom-right causal, within a sliding ``window`` (None: none) -> bool ``B x 1 x L x S``
    (``L x S`` without ``key_mask``), True = may attend; None for the plain causal case (no
    padding and no window shorter than ``S``), which a kernel runs with ``is_causal``."""
    S = offset + L
    windowed = window is not None and window < S
    if key_mask is None and not windowed:
        return None
    mask = (sliding_window_mask(L, S, window, device=device) if windowed
            else causal_mask(L, S, device=device))
    return mask if key_mask is None else key_mask[:, None, None, :] & mask


def padding_mask(
    tokens_or_lengths: Tensor,
    pad_id: int | None = None,
    *,
    max_len: int | None = None,
) -> Tensor:
    """Key mask ``B x S``, True for a real token.

    Either token ids ``B x S`` with ``pad_id`` (True where ``id != pad_id``), or lengths ``B``
    (``pad_id=None``; True for the first ``length`` positions of ``max(lengths)`` or ``max_len``).
    Use it as ``key_mask=`` of the attention modules or expand it with
    :func:`key_mask_to_attention_mask`.
    """
    if not isinstance(tokens_or_lengths, Tensor):
        raise TypeError(
            f"tokens_or_lengths: expected a Tensor, got {type(tokens_or_lengths).__name__}"
        )
    if pad_id is not None:
        if tokens_or_lengths.dim() != 2:
            raise ValueError(
                "tokens_or_lengths: with pad_id, expected token ids of shape B x S, "
                f"got shape {tuple(tokens_or_lengths.shape)}"
            )
        return tokens_or_lengths != pad_id
    lengths = tokens_or_lengths
    if lengths.dim() != 1 or lengths.is_floating_point():
        raise ValueError(
            "tokens_or_lengths: without pad_id, expected integer lengths of shape B, "
            f"got shape {tuple(lengths.shape)} and dtype {lengths.dtype}"
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"tokens_or_lengths: lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    S = longest if max_len is None else max_len
    if longest > S:
        raise ValueError(f"max_len: expected at least the longest length {longest}, got {S}")
    return torch.arange(S, device=lengths.device) < lengths.unsqueeze(-1)


def key_mask_to_attention_mask(key_mask: Tensor) -> Tensor:
    """``B x S`` key mask (see :func:`key_mask_to_bool`) -> bool ``B x 1 x 1 x S``, which
    broadcasts against ``B x H x L x S``."""
    key_mask = key_mask_to_bool(key_mask)
    if key_mask.dim() != 2:
        raise ValueError(f"key_mask: expected shape B x S, got {tuple(key_mask.shape)}")
    return key_mask[:, None, None, :]


def key_mask_to_bool(key_mask: Tensor, name: str = "key_mask") -> Tensor:
    """A key mask of any shape as bool (True = the key may be attended).

    Accepts bool, or integers / floats holding only 0 and 1 (1 = may attend, as Hugging Face's
    ``attention_mask``). Any other value (such as an additive ``-inf`` mask, whose 0 would mean
    "attend") is ambiguous: a ``ValueError`` naming ``name`` (the caller's argument).
    """
    if not isinstance(key_mask, Tensor):
        raise TypeError(f"{name}: expected a bool or 0/1 Tensor, got {type(key_mask).__name__}")
    if key_mask.dtype == torch.bool:
        return key_mask
    if key_mask.is_complex():
        raise TypeError(f"{name}: expected a bool or 0/1 tensor, got dtype {key_mask.dtype}")
    bad = key_mask[(key_mask != 0) & (key_mask != 1)]
    if bad.numel():
        raise ValueError(
            f"{name}: expected bool or 0/1 values (1 = may attend), got a {key_mask.dtype} mask "
            f"holding {bad.unique()[:4].tolist()}; an additive 0/-inf mask goes to `mask`"
        )
    return key_mask != 0


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of "may attend" for boolean masks (``None`` entries are skipped).

    If any mask is a float (additive) mask, all are turned additive and summed, which is the
    same AND for 0/-inf masks and keeps additive biases. Returns ``None`` when all are ``None``.
    Shapes broadcast.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    float_masks = [m for m in present if m.is_floating_point()]
    if float_masks:
        dtype = float_masks[0].dtype
        out = to_additive(present[0], dtype)
        for m in present[1:]:
            out = out + to_additive(m, dtype)
        return out
    out = to_bool(present[0])
    for m in present[1:]:
        out = out & to_bool(m)
    return out


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Boolean mask -> additive float mask (0 where True, ``-inf`` where False).

    A float mask is returned cast to ``dtype``.
    """
    if mask.is_floating_point():
        return mask.to(dtype)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool or float tensor, got dtype {mask.dtype}")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def to_bool(mask: Tensor) -> Tensor:
    """Additive float mask -> boolean mask (True where the value is not ``-inf``).

    A boolean mask is returned as is; 0/1 integer masks (Hugging Face style) become bool, and
    integers other than 0/1 are refused (:func:`key_mask_to_bool`).
    """
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask != float("-inf")
    return key_mask_to_bool(mask, "mask")


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """PyTorch's ``key_padding_mask`` (True = ignore, ``B x S``) -> bool key mask (True = attend).

    A bool or 0/1 integer mask is negated. A float one is additive in PyTorch: one holding only
    0 and ``-inf`` becomes True where 0; other values (biases) are not a key mask and raise.
    """
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(
            f"key_padding_mask: expected a Tensor, got {type(key_padding_mask).__name__}"
        )
    if key_padding_mask.is_floating_point():
        blocked = key_padding_mask == float("-inf")
        if not bool((blocked | (key_padding_mask == 0)).all()):
            raise ValueError(
                "key_padding_mask: a float mask is additive in PyTorch; expected only 0 and "
                "-inf, got other values; pass a bias as `mask` of shape B x 1 x 1 x S instead"
            )
        return ~blocked
    return ~key_mask_to_bool(key_padding_mask, "key_padding_mask")


def from_hf_attention_mask(attention_mask: Tensor) -> Tensor:
    """Hugging Face ``attention_mask`` (1 = real token, 0 = padding, ``B x S``) -> bool key mask."""
    attention_mask = key_mask_to_bool(attention_mask, "attention_mask")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected shape B x S, got {tuple(attention_mask.shape)}")
    return attention_mask


def _check_length(name: str, value: int) -> None:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
