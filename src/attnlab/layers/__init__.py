"""Building blocks: position encodings, feed-forward networks and normalisation."""

from attnlab.layers.feedforward import FeedForward, SwiGLU
from attnlab.layers.norms import RMSNorm
from attnlab.layers.positional import (
    LearnedPositionalEmbedding,
    RoPE,
    SinusoidalPositionalEncoding,
    positions_from_offset,
)

__all__ = [
    "FeedForward",
    "LearnedPositionalEmbedding",
    "RMSNorm",
    "RoPE",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "positions_from_offset",
]
