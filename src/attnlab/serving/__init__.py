"""Serving: a paged KV cache (``paged_cache``), attention over its pages
(``paged_attention``), continuous batching (``scheduler``) and the engine behind
``attnlab serve`` (``engine``)."""

from attnlab.serving.engine import Engine, QueueFull, SamplingParams, TokenEvent
from attnlab.serving.paged_attention import (
    PackedPagedKVCache,
    PagedKVCache,
    PagedRow,
    packed_hidden,
    paged_forward,
    paged_hidden,
)
from attnlab.serving.paged_cache import PagePool, page_hashes

__all__ = ["Engine", "PackedPagedKVCache", "PagePool", "PagedKVCache", "PagedRow", "QueueFull",
           "SamplingParams", "TokenEvent", "packed_hidden", "page_hashes", "paged_forward",
           "paged_hidden"]
