"""A short demonstration of attention: masks, backends that agree, weights that sum to one."""

from __future__ import annotations

import torch

from attnlab.attention import MultiHeadAttention
from attnlab.functional import scaled_dot_product_attention
from attnlab.masks import causal_mask, combine_masks, padding_mask

__all__ = ["run_attention_demo"]


def run_attention_demo() -> None:
    """Print what attention does on a tiny example, and show that the backends agree."""
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 6, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    lengths = torch.tensor([6, 4])
    mask = combine_masks(causal_mask(L), padding_mask(lengths)[:, None, None, :])
    print("Causal mask (True = may attend), 6 x 6:")
    print(causal_mask(L).int())
    print("\nCausal + padding mask of the second sequence (length 4):")
    print(mask[1, 0].int())

    out, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    print("\nAttention weights of sequence 2, head 0 (rows sum to 1; rows sum to 0 where a")
    print("query has nothing to attend to):")
    print(weights[1, 0].round(decimals=2))
    print("\nThe three backends agree (max |difference| to math):")
    for backend in ("flash", "fused"):
        other = scaled_dot_product_attention(q, k, v, mask, backend=backend)
        print(f"  {backend:5s}: {(other - out).abs().max().item():.2e}")

    mha = MultiHeadAttention(embed_dim=32, num_heads=8, num_kv_heads=2)
    x = torch.randn(B, L, 32)
    y, w = mha(x, is_causal=True, key_mask=padding_mask(lengths), return_weights=True)
    print(
        f"\nGrouped-query MultiHeadAttention (8 query heads, 2 key/value heads): "
        f"{tuple(x.shape)} -> {tuple(y.shape)}, weights {tuple(w.shape)}"
    )
    print(f"Parameters: {sum(p.numel() for p in mha.parameters())}")
