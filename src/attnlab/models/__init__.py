"""Models: the encoder-decoder ``Transformer`` and the decoder-only ``DecoderLM``."""

from attnlab.models.decoder import DecoderBlock, DecoderLM, DecoderLMConfig
from attnlab.models.summary import count_parameters, summary
from attnlab.models.transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    Transformer,
    TransformerConfig,
)

__all__ = [
    "Decoder",
    "DecoderBlock",
    "DecoderLM",
    "DecoderLMConfig",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "Transformer",
    "TransformerConfig",
    "count_parameters",
    "summary",
]
