"""Serving: the page bookkeeping (``paged_cache``), continuous batching (``scheduler``), the
runner that owns the pages and runs the model over them (``runner``; attention over the
pages is ``attnlab.attention.paged``), the engine behind ``attnlab serve`` (``engine``) and
its speculative decoding (``speculation``)."""

from attnlab.serving.engine import Engine, QueueFull, SamplingParams, TokenEvent
from attnlab.serving.paged_cache import Allocation, PagePool, page_hashes
from attnlab.serving.params import Speculation
from attnlab.serving.runner import ModelRunner, PagedRow, PreparedStep

__all__ = ["Allocation", "Engine", "ModelRunner", "PagePool", "PagedRow", "PreparedStep",
           "QueueFull", "SamplingParams", "Speculation", "TokenEvent", "page_hashes"]
