"""Tutorial 5, the encoder-decoder Transformer: the exercises.

Fill in each function (and each ``forward``), then run ``attnlab exercises check 5`` (or
``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math

import torch
from torch import Tensor, nn

from attnlab.attention import MultiHeadAttention
from attnlab.layers import FeedForward
from attnlab.models import Transformer

# --8<-- [end:imports]

EXERCISES = {
    "5.1": "parameter_counts",
    "5.2": "positions_changed",
    "5.3": "encoder_stream_rms",
    "5.4": "head_dim",
    "5.5": "MyEncoderLayer.forward",
    "5.6": "MyDecoderLayer.forward",
    "5.7": "attention_with_dropout",
}


# --8<-- [start:parameter_counts]
def parameter_counts(E: int, F: int, src_vocab_size: int, tgt_vocab_size: int,
                     num_encoder_layers: int, num_decoder_layers: int) -> dict[str, int]:
    """The parameters of a Post-LN ``Transformer`` with biases and the output projection tied
    to the target embedding, by hand: ``{"attention", "ffn", "encoder_layer",
    "decoder_layer", "embeddings", "total"}``. E is ``d_model``, F is ``d_ff``."""
    attention = 4 * E * E + 4 * E  # Q, K, V and output projections, with biases
    ffn = 2 * E * F + F + E
    norm = 2 * E
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    embeddings = (src_vocab_size + tgt_vocab_size) * E
    total = num_encoder_layers * encoder_layer + num_decoder_layers * decoder_layer + embeddings
    return {"attention": attention, "ffn": ffn, "encoder_layer": encoder_layer,
            "decoder_layer": decoder_layer, "embeddings": embeddings, "total": total}
# --8<-- [end:parameter_counts]


# --8<-- [start:positions_changed]
def positions_changed(model: Transformer, src: Tensor, tgt: Tensor, position: int) -> Tensor:
    """Which target positions' logits change when the target token at ``position`` is
    replaced by another: a bool tensor of length T (``src`` B x S, ``tgt`` B x T ids)."""
    changed = tgt.clone()
    changed[:, position] = (changed[:, position] + 1) % model.config.tgt_vocab_size
    with torch.no_grad():
        diff = (model(src, changed) - model(src, tgt)).abs()
    return diff.amax(dim=(0, 2)) > 0
# --8<-- [end:positions_changed]


# --8<-- [start:encoder_stream_rms]
def encoder_stream_rms(model: Transformer, src: Tensor) -> list[float]:
    """The root-mean-square of the residual stream after each encoder layer (one float per
    layer, in order), recorded with forward hooks while the model encodes ``src``."""
    rms: list[float] = []
    hooks = [layer.register_forward_hook(
                 lambda mod, args, out: rms.append(out.pow(2).mean().sqrt().item()))
             for layer in model.encoder.layers]
    try:
        with torch.no_grad():
            model.encode(src)
    finally:
        for h in hooks:
            h.remove()
    return rms
# --8<-- [end:encoder_stream_rms]


# --8<-- [start:head_dim]
def head_dim(d_model: int, num_heads: int) -> int:
    """D = E / H, the size of one head; a ``ValueError`` that names ``d_model`` and
    ``num_heads`` when E is not a multiple of H (the heads are concatenated back to E)."""
    if d_model % num_heads:
        raise ValueError(f"d_model: expected a multiple of num_heads={num_heads}, "
                         f"got {d_model}")
    return d_model // num_heads
# --8<-- [end:head_dim]


# --8<-- [start:MyEncoderLayer]
class MyEncoderLayer(nn.Module):
    """Self-attention then FFN, each with a residual and a LayerNorm (Post-LN:
    x = norm(x + sublayer(x)); Pre-LN with ``norm_first``: x = x + sublayer(norm(x))).
    ``B x S x E`` -> same. Its submodules have the names of ``attnlab.models.EncoderLayer``
    (no dropout: the check is in eval mode)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *,
                 norm_first: bool = False) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x ``B x S x E``; ``mask`` bool, True = may attend, broadcasting to
        ``B x H x S x S`` (a padding mask from ``key_mask_to_attention_mask``)."""
        if self.norm_first:
            x = x + self.self_attn(self.norm1(x), mask=mask)
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self.self_attn(x, mask=mask))
        return self.norm2(x + self.ffn(x))
# --8<-- [end:MyEncoderLayer]


# --8<-- [start:MyDecoderLayer]
class MyDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder's output ``memory`` (queries from
    the decoder, keys and values from ``memory``), then FFN; each with a residual and a
    LayerNorm as in ``MyEncoderLayer``. ``B x T x E`` -> same. Submodule names as in
    ``attnlab.models.DecoderLayer``."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *,
                 norm_first: bool = False) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads)
        self.cross_attn = MultiHeadAttention(d_model, num_heads)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None = None) -> Tensor:
        """x ``B x T x E``, memory ``B x S x E``; ``memory_mask`` bool (True = may attend),
        broadcasting to ``B x H x T x S``. The self-attention is causal."""
        if self.norm_first:
            x = x + self.self_attn(self.norm1(x), is_causal=True)
            x = x + self.cross_attn(self.norm2(x), memory, mask=memory_mask)
            return x + self.ffn(self.norm3(x))
        x = self.norm1(x + self.self_attn(x, is_causal=True))
        x = self.norm2(x + self.cross_attn(x, memory, mask=memory_mask))
        return self.norm3(x + self.ffn(x))
# --8<-- [end:MyDecoderLayer]


# --8<-- [start:attention_with_dropout]
def attention_with_dropout(q: Tensor, k: Tensor, v: Tensor, p: float, *,
                           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Attention dropout: softmax(q kᵀ / √D) with each weight zeroed with probability ``p``
    (drawn with ``generator``) and the others divided by 1 - p, so that the expected weights
    are unchanged; then the weights times v. q ``N.. x L x D``, k ``N.. x S x D``, v
    ``N.. x S x Dv``; returns (the output ``N.. x L x Dv``, the dropped weights
    ``N.. x L x S``)."""
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    keep = torch.rand(weights.shape, generator=generator) >= p
    dropped = weights * keep / (1 - p)
    return dropped @ v, dropped
# --8<-- [end:attention_with_dropout]
