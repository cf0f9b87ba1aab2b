"""Models: the encoder-decoder ``Transformer`` and the decoder-only ``DecoderLM``, with
``from_pretrained`` / ``save_pretrained`` for Hugging Face checkpoint folders of the
families in ``attnlab.models.families`` (Llama, Mistral, Qwen2, Qwen3, ...)."""

from attnlab.models.decoder import DecoderBlock, DecoderLM, DecoderLMConfig
from attnlab.models.families import PRESETS, preset
from attnlab.models.gguf_export import export_gguf
from attnlab.models.io import from_pretrained, save_pretrained
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
    "PRESETS",
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
    "export_gguf",
    "from_pretrained",
    "preset",
    "save_pretrained",
    "summary",
]
