"""What the decoding loops need of a model, as Protocols: generation knows no model class.

``generate`` drives any ``CausalLM`` and ``generate_seq2seq`` any ``Seq2SeqLM``;
``attnlab.models.DecoderLM`` and ``attnlab.models.Transformer`` are such models (their
``generate`` methods call these loops). Typing them structurally keeps generation below
models in the import layers (``.importlinter``), as in transformers, where the generation
loop is a mixin that knows models only through the methods it calls.

The protocols are runtime-checkable: the loops refuse, by name, a model or a config that
lacks one of their members (``isinstance`` looks at the names, not at the signatures).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from attnlab.attention.kv_cache import KVCache

__all__ = ["CausalLM", "CausalLMConfig", "Seq2SeqLM", "Seq2SeqLMConfig", "Streamer"]


@runtime_checkable
class CausalLMConfig(Protocol):
    """A causal LM's sizes: vocabulary ``V`` and number of positions."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...


@runtime_checkable
class CausalLM(Protocol):
    """``model(input_ids B x L, attention_mask=, cache=, logits_to_keep=) -> logits B x k x V``
    and ``model.make_cache(batch_size, max_len) -> KVCache``; optionally
    ``model.cache_expires(length) -> bool``, asked before each decoding step (True: the cache
    is reset and the whole sequence run again), and ``model.greedy(logits) -> ids``, the
    greedy choice (default ``greedy_tokens``)."""

    @property
    def config(self) -> CausalLMConfig: ...

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                 cache: KVCache | None = None, logits_to_keep: int = 0) -> Tensor: ...

    def make_cache(self, batch_size: int, max_len: int | None = None) -> KVCache: ...


@runtime_checkable
class Seq2SeqLMConfig(Protocol):
    """An encoder-decoder's sizes: both vocabularies, positions, its padding id."""

    @property
    def src_vocab_size(self) -> int: ...

    @property
    def tgt_vocab_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    @property
    def pad_id(self) -> int | None: ...


@runtime_checkable
class Seq2SeqLM(Protocol):
    """Encoder-decoder: ``source_mask`` (``B x S`` key mask or ``None``), ``encode`` (memory
    ``B x S x E``), ``decode`` (logits ``B x T x V``, extending a ``KVCache``), ``make_cache``."""

    @property
    def config(self) -> Seq2SeqLMConfig: ...

    def source_mask(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor | None: ...

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor: ...

    def decode(self, tgt: Tensor, memory: Tensor, memory_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor: ...

    def make_cache(self, batch_size: int, max_len: int | None = None) -> KVCache: ...


class Streamer(Protocol):
    """Receives tokens as they are made: ``put(ids B)`` once per step (once per token under
    speculative decoding), ``end()`` at the end."""

    def put(self, token_ids: Tensor) -> None: ...

    def end(self) -> None: ...
