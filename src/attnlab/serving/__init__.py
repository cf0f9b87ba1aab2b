"""Serving: a paged KV cache (``paged_cache``), attention over its pages
(``paged_attention``), continuous batching (``scheduler``) and the engine behind
``attnlab serve`` (``engine``)."""

from attnlab.serving.engine import Engine, QueueFull, SamplingParams, TokenEvent
from attnlab.serving.paged_attention import PagedKVCache, PagedRow, paged_forward, paged_hidden
from attnlab.serving.paged_cache import PagePool, page_hashes

__all__ = ["Engine", "PagePool", "PagedKVCache", "PagedRow", "QueueFull", "SamplingParams",
           "TokenEvent", "page_hashes", "paged_forward", "paged_hidden"]
