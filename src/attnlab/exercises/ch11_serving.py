"""Tutorial 11, serving: the exercises.

Fill in each function, then run ``attnlab exercises check 11`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import hashlib
import math

from attnlab.serving import Engine, SamplingParams

# --8<-- [end:imports]

EXERCISES = {
    "11.1": "pages_and_bytes",
    "11.2": "drain",
    "11.3": "runs_out_of_pages",
    "11.4": "chain_hashes",
    "11.5": "check_step_budget",
}


# --8<-- [start:pages_and_bytes]
def pages_and_bytes(tokens: int, page_size: int, layers: int, kv_heads: int, head_dim: int,
                    element_bytes: int) -> tuple[int, int]:
    """(the pages one request of ``tokens`` tokens needs, the bytes of one page): a page
    holds keys and values of ``page_size`` tokens for every layer and key/value head."""
    pages = math.ceil(tokens / page_size)
    page_bytes = 2 * layers * kv_heads * page_size * head_dim * element_bytes
    return pages, page_bytes
# --8<-- [end:pages_and_bytes]


# --8<-- [start:drain]
def drain(engine: Engine, requests: dict[str, list[int]], max_tokens: int,
          per_step: int | None = None) -> dict[str, list[int]]:
    """Run greedy requests (``{request_id: prompt ids}``, added in that order, ``per_step`` of
    them before each step, or all at once when None) through ``engine`` until it has no work;
    return each request's generated token ids."""
    pending = list(requests)
    out: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while pending or engine.has_work():
        for _ in range(min(len(pending), per_step or len(pending))):
            request_id = pending.pop(0)
            engine.add_request(requests[request_id],
                               SamplingParams(max_tokens=max_tokens, temperature=0),
                               request_id=request_id)
        for event in engine.step():
            out[event.request_id].append(event.token_id)
    return out
# --8<-- [end:drain]


# --8<-- [start:runs_out_of_pages]
def runs_out_of_pages(prompt_lengths: list[int], max_tokens: int, page_size: int,
                      kv_pages: int) -> bool:
    """Whether requests with these prompt lengths, each generating ``max_tokens`` tokens side
    by side, need more pages at the end than the pool's ``kv_pages``."""
    needed = sum(math.ceil((n + max_tokens) / page_size) for n in prompt_lengths)
    return needed > kv_pages
# --8<-- [end:runs_out_of_pages]


# --8<-- [start:chain_hashes]
def chain_hashes(tokens: list[int], page_size: int) -> list[bytes]:
    """The chain hash of every full page: h_i = sha256(h_(i-1) || the page's tokens, each as
    8 little-endian signed bytes), h_(-1) = b"", so that h_i names the whole prefix."""
    hashes, previous = [], b""
    for i in range(len(tokens) // page_size):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        previous = hashlib.sha256(
            previous + b"".join(t.to_bytes(8, "little", signed=True) for t in chunk)).digest()
        hashes.append(previous)
    return hashes
# --8<-- [end:chain_hashes]


# --8<-- [start:check_step_budget]
def check_step_budget(max_batch: int, max_tokens_per_step: int) -> None:
    """Refuse a step budget below one token per running request: a ``ValueError`` naming
    ``max_tokens_per_step`` and both values when it is less than ``max_batch``."""
    if max_tokens_per_step < max_batch:
        raise ValueError(f"max_tokens_per_step: expected at least max_batch={max_batch} "
                         f"(every running request decodes a token per step), got "
                         f"{max_tokens_per_step}")
# --8<-- [end:check_step_budget]
