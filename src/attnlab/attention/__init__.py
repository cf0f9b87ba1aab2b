"""Attention backends and the multi-head modules built on them."""

from attnlab.attention.flash import flash_attention
from attnlab.attention.fused import fused_attention
from attnlab.attention.math import math_attention
from attnlab.attention.multihead import MultiHeadAttention, SimpleMultiHeadAttention

__all__ = [
    "MultiHeadAttention",
    "SimpleMultiHeadAttention",
    "flash_attention",
    "fused_attention",
    "math_attention",
]
