"""Attention: the backends, the one dispatching entry point, the multi-head modules and the
key/value cache they fill."""

from attnlab.attention.flash import flash_attention
from attnlab.attention.fused import fused_attention
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.math import math_attention
from attnlab.attention.multihead import MultiHeadAttention, SimpleMultiHeadAttention
from attnlab.attention.sdpa import BACKENDS, scaled_dot_product_attention

__all__ = [
    "BACKENDS",
    "KVCache",
    "LayerKVCache",
    "MultiHeadAttention",
    "SimpleMultiHeadAttention",
    "flash_attention",
    "fused_attention",
    "math_attention",
    "scaled_dot_product_attention",
]
