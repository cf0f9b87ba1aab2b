"""Building blocks: position encodings, feed-forward networks, normalisation and the
decoder's self-attention."""

from attnlab.layers.feedforward import ACTIVATIONS, FeedForward, GatedMLP, SwiGLU
from attnlab.layers.norms import RMSNorm
from attnlab.layers.positional import (
    LearnedPositionalEmbedding,
    RoPE,
    SinusoidalPositionalEncoding,
    positions_from_offset,
)

__all__ = [
    "ACTIVATIONS",
    "FeedForward",
    "GatedMLP",
    "LearnedPositionalEmbedding",
    "RMSNorm",
    "RoPE",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "positions_from_offset",
]
