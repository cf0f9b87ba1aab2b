"""attnlab: a Transformer toolkit for PyTorch, built from the mathematics up."""

from attnlab import functional, masks
from attnlab.attention import (
    MultiHeadAttention,
    SimpleMultiHeadAttention,
    scaled_dot_product_attention,
)
from attnlab.formulas import linear, softmax

__version__ = "0.1.0"

__all__ = [
    "MultiHeadAttention",
    "SimpleMultiHeadAttention",
    "functional",
    "linear",
    "masks",
    "scaled_dot_product_attention",
    "softmax",
]
