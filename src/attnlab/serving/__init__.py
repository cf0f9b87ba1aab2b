"""Serving: the page bookkeeping (``paged_cache``), continuous batching (``scheduler``), the
runner that owns the pages and runs the model over them (``runner``; attention over the
pages is ``attnlab.attention.paged``) and the engine behind ``attnlab serve``
(``engine``)."""

from attnlab.serving.engine import Engine, QueueFull, SamplingParams, TokenEvent
from attnlab.serving.paged_cache import Allocation, PagePool, page_hashes
from attnlab.serving.runner import ModelRunner, PagedRow, PreparedStep

__all__ = ["Allocation", "Engine", "ModelRunner", "PagePool", "PagedRow", "PreparedStep",
           "QueueFull", "SamplingParams", "TokenEvent", "page_hashes"]
