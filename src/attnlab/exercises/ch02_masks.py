"""Tutorial 2, masks: the exercises.

Fill in each function, then run ``attnlab exercises check 2`` (or ``pytest exercises/``).
Every boolean mask means True = may attend.
"""

from __future__ import annotations

# --8<-- [start:imports]
import torch
from torch import Tensor

from attnlab import masks
from attnlab.attention import scaled_dot_product_attention

# --8<-- [end:imports]

EXERCISES = {
    "2.1": "batch_causal_padding_mask",
    "2.2": "padded_self_attention",
    "2.3": "to_key_mask",
    "2.4": "cached_step_mask",
    "2.5": "empty_rows",
}


# --8<-- [start:batch_causal_padding_mask]
def batch_causal_padding_mask(lengths: Tensor, L: int) -> Tensor:
    """The mask of a right-padded batch of sentences of ``lengths`` (``B``) padded to ``L``,
    with causal attention: bool ``B x 1 x L x L`` (broadcasting against ``B x H x L x S``);
    query i of sentence b may attend key j when j <= i and j < lengths[b]."""
    key_mask = masks.padding_mask(lengths, max_len=L)  # B x S: True = a real token
    return masks.combine_masks(masks.key_mask_to_attention_mask(key_mask),
                               masks.causal_mask(L))
# --8<-- [end:batch_causal_padding_mask]


# --8<-- [start:padded_self_attention]
def padded_self_attention(x: Tensor, padding: Tensor, *, causal: bool) -> Tensor:
    """Self-attention (q = k = v) over the sentence ``x`` (``n x D``) followed by the padding
    vectors ``padding`` (``P x D``), with a key mask that hides the padding: ``(n + P) x D``.
    The first n rows equal the attention of ``x`` alone."""
    padded = torch.cat([x, padding])[None, None]  # 1 x 1 x (n + P) x D
    keep = masks.padding_mask(torch.tensor([len(x)]), max_len=len(padded[0, 0]))
    out = scaled_dot_product_attention(padded, padded, padded,
                                       masks.key_mask_to_attention_mask(keep), is_causal=causal)
    return out[0, 0]
# --8<-- [end:padded_self_attention]


# --8<-- [start:to_key_mask]
def to_key_mask(mask: Tensor, convention: str) -> Tensor:
    """attnlab's key mask (bool ``B x S``, True = a real token) from PyTorch's
    ``key_padding_mask`` (``convention="pytorch"``: True = padding) or a Hugging Face
    ``attention_mask`` (``convention="hf"``: 1 = a real token); ``ValueError`` naming
    ``convention`` for any other."""
    if convention == "pytorch":
        return ~mask.bool()
    if convention == "hf":
        return mask.bool()
    raise ValueError(f"convention: expected 'pytorch' or 'hf', got {convention!r}")
# --8<-- [end:to_key_mask]


# --8<-- [start:cached_step_mask]
def cached_step_mask(cached: int, new: int) -> Tensor:
    """The causal mask of a decoding step: ``new`` queries over ``cached + new`` keys, bool
    ``new x (cached + new)``; new query i is at position ``cached + i`` and sees keys up to
    it (bottom-right aligned)."""
    S = cached + new
    return torch.arange(S)[None, :] <= torch.arange(new)[:, None] + cached
# --8<-- [end:cached_step_mask]


# --8<-- [start:empty_rows]
def empty_rows(lengths: Tensor, L: int, *, left: bool) -> list[int]:
    """For sentences of ``lengths`` padded to ``L`` (on the left when ``left``, else on the
    right) with causal attention: how many query rows of each sentence have no key at all."""
    keep = masks.padding_mask(lengths, max_len=L)
    if left:
        keep = keep.flip(-1)  # the same lengths, padded on the left
    both = masks.combine_masks(masks.key_mask_to_attention_mask(keep), masks.causal_mask(L))
    return (~both.any(dim=-1)).sum(dim=-1).flatten().tolist()
# --8<-- [end:empty_rows]
