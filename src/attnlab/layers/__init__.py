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
from attnlab.layers.rope_scaling import RopeScaling, rope_inverse_frequencies
from attnlab.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = [
    "ACTIVATIONS",
    "FeedForward",
    "GatedMLP",
    "LearnedPositionalEmbedding",
    "RMSNorm",
    "RoPE",
    "RopeScaling",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "apply_rotary",
    "positions_from_offset",
    "rope_inverse_frequencies",
]
