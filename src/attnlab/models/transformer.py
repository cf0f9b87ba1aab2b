"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

``Transformer(config)(src B x S, tgt B x T) -> logits B x T x V``:

- encoder: ``x = PE(emb(src) * sqrt(E))``, then N layers of self-attention + FFN;
- decoder: ``y = PE(emb(tgt) * sqrt(E))``, then N layers of causal self-attention,
  cross-attention (queries from the decoder, keys/values from the encoder's memory) + FFN;
- logits: ``y W_out^T`` (``W_out`` tied to the target embedding by default).

Each sub-layer is ``x = LN(x + Dropout(f(x)))`` (``norm_first=False``, Post-LN, the paper)
or ``x = x + Dropout(f(LN(x)))`` (``norm_first=True``, Pre-LN, with a final LN after the
stack). The layers mirror ``torch.nn.Transformer`` parameter for parameter, so weights copy
across (see ``tests/models/test_transformer_parity.py``); note that ``torch.nn.Transformer``
always adds the final norms (``final_norm=True`` here).

Masks are key masks, True (or 1) = a real token: ``src_mask`` ``B x S``, ``tgt_mask``
``B x T``; when not given they are ``tokens != pad_id``. The decoder is always causal.

The Hugging Face call surface, as ``DecoderLM``'s: ``model(src, tgt, labels=,
past_key_values=, use_cache=)`` returns a ``Seq2SeqLMOutput`` (``attnlab.models.outputs``);
``generate`` (greedy or beam search); ``save_pretrained``/``from_pretrained``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn

from attnlab._checks import check_positive, check_tensor, check_token_ids
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.multihead import MultiHeadAttention
from attnlab.attention.sdpa import BACKENDS
from attnlab.generation import generate_seq2seq
from attnlab.layers import FeedForward, SinusoidalPositionalEncoding, initialisation
from attnlab.models.config import ConfigMixin
from attnlab.models.outputs import (
    Seq2SeqLMOutput,
    check_hf_keywords,
    check_labels,
    next_token_loss,
)
from attnlab.models.pretrained import PreTrainedModel
from attnlab.models.summary import summary

__all__ = ["Decoder", "DecoderLayer", "Encoder", "EncoderLayer", "Transformer",
           "TransformerConfig"]


@dataclass(frozen=True)
class TransformerConfig(ConfigMixin):
    """Sizes and options of a ``Transformer`` (defaults: the paper's base model).

    ``final_norm`` (a LayerNorm after each stack) defaults to ``norm_first``.
    ``tie_output`` ties the output projection to the target embedding;
    ``share_embeddings`` also ties the source embedding to it (needs equal vocabularies).
    ``pad_id=None`` means no padding masks are built.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    activation: Literal["relu", "gelu"] = "relu"
    norm_first: bool = False
    final_norm: bool | None = None
    layer_norm_eps: float = 1e-5
    max_len: int = 512
    pad_id: int | None = 0
    tie_output: bool = True
    share_embeddings: bool = False
    bias: bool = True
    backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads",
                     "num_encoder_layers", "num_decoder_layers", "d_ff", "max_len"):
            value = getattr(self, name)
            check_positive(name, value)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model: expected a multiple of num_heads={self.num_heads}, "
                             f"got {self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {self.dropout}")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps: expected a positive number, got "
                             f"{self.layer_norm_eps}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings: needs src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        if self.pad_id is not None and not 0 <= self.pad_id < min(self.src_vocab_size,
                                                                  self.tgt_vocab_size):
            raise ValueError(f"pad_id: expected None or an id below both vocabulary sizes, "
                             f"got {self.pad_id}")

    @property
    def use_final_norm(self) -> bool:
        return self.norm_first if self.final_norm is None else self.final_norm


class EncoderLayer(nn.Module):
    """Self-attention + FFN, each with residual, dropout and LayerNorm. ``B x S x E`` -> same."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, layer_norm_eps: float = 1e-5,
                 bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias,
                                            backend=backend)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x ``B x S x E``; ``mask`` bool, broadcasting to ``B x H x S x S`` (True = attend)."""
        def sa(h: Tensor) -> Tensor:
            return self.dropout(self.self_attn(h, mask=mask))

        def ff(h: Tensor) -> Tensor:
            return self.dropout(self.ffn(h))

        if self.norm_first:
            x = x + sa(self.norm1(x))
            return x + ff(self.norm2(x))
        x = self.norm1(x + sa(x))
        return self.norm2(x + ff(x))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to ``memory``, FFN. ``B x T x E`` -> same."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, layer_norm_eps: float = 1e-5,
                 bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias,
                                            backend=backend)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias,
                                             backend=backend)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, cache: LayerKVCache | None = None) -> Tensor:
        """x ``B x T x E``, memory ``B x S x E``.

        ``self_mask`` broadcasts to ``B x H x T x (offset + T)``, ``memory_mask`` to
        ``B x H x T x S`` (bool, True = attend); the causal mask is always added. With
        ``cache`` (this layer's ``LayerKVCache``), ``x`` holds only the new positions.
        """
        def sa(h: Tensor) -> Tensor:
            return self.dropout(self.self_attn(h, mask=self_mask, is_causal=True, cache=cache))

        def ca(h: Tensor) -> Tensor:
            return self.dropout(self.cross_attn(h, memory, mask=memory_mask))

        def ff(h: Tensor) -> Tensor:
            return self.dropout(self.ffn(h))

        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + ca(self.norm2(x))
            return x + ff(self.norm3(x))
        x = self.norm1(x + sa(x))
        x = self.norm2(x + ca(x))
        return self.norm3(x + ff(x))


class _Stack(nn.Module):
    """What the encoder and the decoder share: scaled embedding + sinusoidal positions, a stack
    of ``layer`` modules, an optional final LayerNorm."""

    def __init__(self, config: TransformerConfig, layer: type[nn.Module], vocab_size: int,
                 num_layers: int) -> None:
        super().__init__()
        c = config
        self.scale = math.sqrt(c.d_model)
        self.embed = initialisation.embedding(vocab_size, c.d_model)
        self.pos = SinusoidalPositionalEncoding(c.d_model, c.max_len, c.dropout)
        self.layers = nn.ModuleList(
            layer(c.d_model, c.num_heads, c.d_ff, dropout=c.dropout, activation=c.activation,
                  norm_first=c.norm_first, layer_norm_eps=c.layer_norm_eps, bias=c.bias,
                  backend=c.backend)
            for _ in range(num_layers)
        )
        self.norm = (nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
                     if c.use_final_norm else None)


class Encoder(_Stack):
    """``src`` ids ``B x S`` -> memory ``B x S x E``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config, EncoderLayer, config.src_vocab_size, config.num_encoder_layers)

    def forward(self, src: Tensor, mask: Tensor | None = None) -> Tensor:
        """``mask``: bool, broadcasting to ``B x H x S x S`` (True = attend)."""
        x = self.pos(self.embed(src) * self.scale)
        for layer in self.layers:
            x = layer(x, mask)
        return x if self.norm is None else self.norm(x)


class Decoder(_Stack):
    """``tgt`` ids ``B x T`` and memory ``B x S x E`` -> hidden states ``B x T x E``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config, DecoderLayer, config.tgt_vocab_size, config.num_decoder_layers)

    def forward(self, tgt: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """With ``cache``, ``tgt`` holds the new tokens at positions ``cache.length ..``."""
        offset = 0 if cache is None else cache.length
        x = self.pos(self.embed(tgt) * self.scale, offset=offset)
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, self_mask, memory_mask, None if cache is None else cache[i])
        return x if self.norm is None else self.norm(x)


class Transformer(PreTrainedModel):
    """Encoder-decoder Transformer: ``forward(src B x S, tgt B x T) -> logits B x T x V``."""

    MODEL_TYPE = "attnlab_transformer"
    CONFIG_CLASS = TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config: expected a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.output_proj = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_output or config.share_embeddings:
            self.output_proj.weight = self.decoder.embed.weight
        if config.share_embeddings:
            self.encoder.embed.weight = self.decoder.embed.weight

    def reset_parameters(self) -> None:
        """Embeddings ``N(0, 1/E)`` (unit variance after the ``sqrt(E)`` scale), Xavier elsewhere
        (attention as in ``MultiHeadAttention``, the FFN and output like ``torch.nn.Transformer``).
        """
        std = self.config.d_model ** -0.5
        for emb in (self.encoder.embed, self.decoder.embed):
            initialisation.normal_(emb.weight, std=std)
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name and "attn" not in name:
                nn.init.xavier_uniform_(p)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, *, labels: Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None) -> Tensor | Seq2SeqLMOutput:
        """src ``B x S``, tgt ``B x T`` ids -> logits ``B x T x V``.

        ``src_mask`` ``B x S`` and ``tgt_mask`` ``B x T``: True (or 1) = real token; built
        from ``pad_id`` when not given. The decoder adds the causal mask itself.

        Hugging Face keywords (any of them, or ``return_dict=True``, returns a
        ``Seq2SeqLMOutput``): ``labels`` ``B x T`` (the target ids, ``-100`` where no loss is
        wanted; shifted inside: the logits at ``t`` predict ``labels[:, t + 1]``) gives
        ``.loss``; ``past_key_values``, a ``KVCache`` holding the earlier target positions
        (``tgt`` is then the next tokens, ``tgt_mask`` covers all ``B x (offset + T)`` and is
        not built from ``pad_id``, as in ``decode``); ``use_cache=True`` without one makes a
        growing cache. The source is encoded at every call (``.encoder_last_hidden_state``);
        step-by-step decoding that encodes once is ``generate``, or ``encode`` + ``decode``.
        """
        as_output = check_hf_keywords(labels=labels, use_cache=use_cache,
                                      past_key_values=past_key_values, cache=None,
                                      return_dict=return_dict)
        memory = self.encode(src, src_mask)
        cache = past_key_values
        if use_cache and cache is None:
            cache = self.make_cache(*check_token_ids("tgt", tgt, self.config.tgt_vocab_size),
                                    grow=True)
        logits = self.decode(tgt, memory, memory_mask=self._key_mask("src_mask", src, src_mask),
                             tgt_mask=tgt_mask, cache=cache)
        if not as_output:
            return logits
        loss = None
        if labels is not None:
            loss = next_token_loss(logits, check_labels(labels, tuple(tgt.shape),
                                                        self.config.tgt_vocab_size))
        return Seq2SeqLMOutput(logits=logits, loss=loss, past_key_values=cache,
                               encoder_last_hidden_state=memory)

    def generate(self, src: Tensor, max_new_tokens: int, **kwargs: Any
                 ) -> Tensor | tuple[Tensor, Tensor]:
        """``attnlab.generation.generate_seq2seq(self, src, max_new_tokens, **kwargs)``:
        greedy (``num_beams=1``) or beam search from ``bos_id`` until ``eos_id``; ids
        ``B x (1 + n)`` (and the scores with ``return_scores=True``)."""
        return generate_seq2seq(self, src, max_new_tokens, **kwargs)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src ids ``B x S`` -> memory ``B x S x E`` (``src_mask`` as in ``forward``)."""
        check_token_ids("src", src, self.config.src_vocab_size)
        mask = self._key_mask("src_mask", src, src_mask)
        return self.encoder(src, None if mask is None else mask[:, None, None, :])

    def decode(self, tgt: Tensor, memory: Tensor, memory_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """tgt ids ``B x T``, memory ``B x S x E`` -> logits ``B x T x V``.

        ``memory_mask`` ``B x S``: True = real source token (no mask when ``None``).
        ``tgt_mask``: ``B x T`` (``B x (offset + T)`` with a cache, covering the cached
        positions too); built from ``pad_id`` when not given and the cache is empty or absent
        (with cached positions, no padding mask is built: the cached tokens are not at hand).
        ``cache``: a ``KVCache`` from ``make_cache``; ``tgt`` then holds only the new tokens,
        at positions ``cache.length ..``, and the cache is extended by them.
        """
        c = self.config
        B, T = check_token_ids("tgt", tgt, c.tgt_vocab_size)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a KVCache (model.make_cache) or None, got "
                            f"{type(cache).__name__}")
        if cache is not None and (len(cache) != c.num_decoder_layers or cache.batch_size != B):
            raise ValueError(f"cache: expected {c.num_decoder_layers} layers for batch size {B}, "
                             f"got {cache!r}")
        offset = 0 if cache is None else cache.length
        if offset + T > c.max_len:
            raise ValueError(f"tgt: positions {offset} .. {offset + T - 1} exceed the model's "
                             f"max_len={c.max_len}")
        check_tensor("memory", memory, "the encoder's output tensor B x S x E")
        if memory.dtype != self.dtype:
            raise ValueError(f"memory: expected dtype {self.dtype} (the "
                             f"model's), got {memory.dtype}")
        if memory.dim() != 3 or memory.shape[0] != B or memory.shape[2] != c.d_model:
            raise ValueError(f"memory: expected shape B x S x E = ({B}, S, {c.d_model}), got "
                             f"{tuple(memory.shape)}")
        if tgt_mask is None and offset == 0:
            tgt_mask = self._key_mask("tgt_mask", tgt, None)
        self_mask = _expand("tgt_mask", tgt_mask, B, offset + T)
        cross_mask = _expand("memory_mask", memory_mask, B, memory.shape[1])
        h = self.decoder(tgt, memory, self_mask, cross_mask, cache)
        return self.output_proj(h)

    def make_cache(self, batch_size: int, max_len: int | None = None, *,
                   grow: bool = False) -> KVCache:
        """An empty ``KVCache`` for the decoder's self-attention (``max_len`` positions;
        ``grow=True``: the room allocated first, doubled when needed)."""
        c = self.config
        return KVCache(c.num_decoder_layers, batch_size, c.num_heads,
                       c.max_len if max_len is None else max_len, c.d_model // c.num_heads,
                       dtype=self.dtype, device=self.device, grow=grow)

    def summary(self, max_depth: int = 2) -> str:
        """The per-module parameter counts as a table (``models.summary``); prints nothing."""
        return summary(self, max_depth=max_depth)

    def source_mask(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor | None:
        """The source key mask ``B x S`` bool (True = real token): ``src_mask`` checked, or
        ``src != pad_id``, or ``None`` (no padding) when the config has no ``pad_id``."""
        return self._key_mask("src_mask", src, src_mask)

    def _key_mask(self, name: str, tokens: Tensor, mask: Tensor | None) -> Tensor | None:
        if mask is not None:
            check_tensor(name, mask, "a bool key mask tensor")
            if tuple(mask.shape) != tuple(tokens.shape):
                raise ValueError(f"{name}: expected a key mask of shape B x len = "
                                 f"{tuple(tokens.shape)}, got {tuple(mask.shape)}")
            return mask.bool()
        if self.config.pad_id is None:
            return None
        return tokens != self.config.pad_id


def _expand(name: str, mask: Tensor | None, B: int, S: int) -> Tensor | None:
    """Key mask ``B x S`` (True/1 = real) -> ``B x 1 x 1 x S`` bool."""
    if mask is None:
        return None
    check_tensor(name, mask, "a bool key mask tensor")
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"{name}: expected a key mask of shape ({B}, {S}), got "
                         f"{tuple(mask.shape)}")
    return mask.bool()[:, None, None, :]
