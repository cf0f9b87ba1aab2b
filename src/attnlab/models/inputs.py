"""The checks every model runs on its inputs before any compute, and the decoder's positions.

``decoder_inputs`` is the head of ``DecoderLM.forward``: it checks ``input_ids``,
``attention_mask``, ``cache``, ``position_ids`` and ``logits_to_keep``, each error naming the
argument, and gives the positions: with an ``attention_mask`` that pads, each real token's
position is the number of real tokens before it (left padding starts at 0), else
``offset .. offset + L - 1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnlab._checks import ID_DTYPES, check_tensor, check_token_ids, is_int
from attnlab.attention.kv_cache import KVCache

__all__ = ["DecoderInputs", "decoder_inputs"]

class DecoderInputs(NamedTuple):
    """``B``, ``L``, the cache ``offset``, the bool ``key_mask`` ``B x (offset + L)`` (``None``
    when nothing is padded) and the ``positions`` (an int offset or a long ``B x L``/``L``
    tensor)."""

    batch: int
    length: int
    offset: int
    key_mask: Tensor | None
    positions: int | Tensor


def decoder_inputs(input_ids: object, attention_mask: object, cache: object,
                   position_ids: object, logits_to_keep: object, *, vocab_size: int,
                   max_len: int, num_layers: int) -> DecoderInputs:
    """Check a causal LM's forward arguments; return what the forward needs.

    ``input_ids`` ``B x L`` ids in ``[0, vocab_size)``; ``attention_mask`` ``B x (offset + L)``
    or ``None``; ``cache`` a ``KVCache`` of ``num_layers`` layers and batch ``B`` (its
    ``length`` is the ``offset``) or ``None``; ``position_ids`` ``B x L`` or ``L`` ints in
    ``[0, max_len)`` or ``None``; ``logits_to_keep`` an int ``>= 0``. Without ``position_ids``,
    ``offset + L`` must not exceed ``max_len``; with them each position is checked instead (a
    packed sequence, a serving step's rows, may be longer than ``max_len``).

    A mask without a padded key is dropped (``key_mask`` ``None``: the plain causal case) and
    its positions are the offset's, computed from the mask only when it pads.
    """
    B, L = check_token_ids("input_ids", input_ids, vocab_size)
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a KVCache (model.make_cache) or None, got "
                        f"{type(cache).__name__}")
    if cache is not None and (len(cache) != num_layers or cache.batch_size != B):
        raise ValueError(f"cache: expected {num_layers} layers for batch size {B}, got "
                         f"{cache!r}")
    offset = 0 if cache is None else cache.length
    if position_ids is None and offset + L > max_len:
        raise ValueError(f"input_ids: positions {offset} .. {offset + L - 1} exceed the "
                         f"model's max_len={max_len}")
    if not is_int(logits_to_keep) \
            or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep: expected an int >= 0, got {logits_to_keep!r}")
    key_mask = None
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask)
        if tuple(attention_mask.shape) != (B, offset + L):
            raise ValueError(f"attention_mask: expected shape B x (offset + L) = "
                             f"({B}, {offset + L}), got {tuple(attention_mask.shape)}")
        key_mask = attention_mask.bool()
        if bool(key_mask.all()):  # no padding: the plain causal path, positions from offset
            key_mask = None
    if position_ids is not None:
        positions: int | Tensor = _check_positions(position_ids, B, L, max_len)
    elif key_mask is None:
        positions = offset
    else:
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:]
    return DecoderInputs(B, L, offset, key_mask, positions)


def _check_positions(position_ids: object, B: int, L: int, max_len: int) -> Tensor:
    check_tensor("position_ids", position_ids)
    if (position_ids.dtype not in ID_DTYPES
            or tuple(position_ids.shape) not in ((B, L), (L,))):
        raise ValueError(f"position_ids: expected integer positions of shape B x L = "
                         f"({B}, {L}) or L, got shape {tuple(position_ids.shape)} and dtype "
                         f"{position_ids.dtype}")
    low, high = torch.stack(torch.aminmax(position_ids)).tolist()
    if low < 0 or high >= max_len:
        raise ValueError(f"position_ids: expected positions in [0, {max_len}), got min {low} "
                         f"and max {high}")
    return position_ids
