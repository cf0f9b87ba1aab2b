"""Continuous batching: which requests run in a step, and how many of their tokens.

Every request is a list of ``tokens`` (prompt, then what it generated) of which ``computed``
have their keys/values in its pages; it runs ``pending = len(tokens) - computed`` tokens
more before the model predicts its next one (``1`` once decoding, the rest of the prompt
while prefilling). A step, under a budget of ``max_tokens_per_step`` tokens:

1. decode: every running request with one pending token gets it, oldest admitted first; its
   next slot may need a new page;
2. prefill: running requests still prefilling get chunks of what budget is left, oldest
   first, so that a long prompt takes several steps and never stalls the decoding ones;
3. admit: waiting requests, first come first served, while fewer than ``max_batch`` run,
   budget is left and the pool has the pages for the request's tokens + 1 (its prefix pages
   found in the prefix cache are shared, not counted); admission never takes pages from a
   running request, and waits for the next step when this one paused a request.

When a decoding request needs a page and none is available, the most recently admitted
request is paused: its pages are released (its full pages stay in the prefix cache, so
that it usually finds them again) and it goes back to the head of the queue with every token
it has, to be prefilled again when pages are free. A request that is itself the newest
pauses itself. No request is ever cut short for lack of pages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from attnlab.serving.paged_cache import PagePool, page_hashes
from attnlab.serving.params import SamplingParams

__all__ = ["Request", "Scheduler"]


@dataclass(eq=False)
class Request:
    """One request's state: ``tokens`` (prompt + generated), ``computed`` of them stored in
    the pages of ``table``, the chain ``hashes`` of its full computed pages."""

    request_id: str
    tokens: list[int]
    prompt_length: int
    params: SamplingParams
    generator: torch.Generator | None
    table: list[int] = field(default_factory=list)
    computed: int = 0
    hashes: list[bytes] = field(default_factory=list)

    @property
    def pending(self) -> int:
        """Tokens to run before the model predicts the next one."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


class Scheduler:
    """The ``waiting`` queue and the ``running`` requests (in admission order) over a
    ``PagePool``; ``schedule()`` plans a step (module docstring), ``advance`` records it."""

    def __init__(self, pool: PagePool, *, max_batch: int, max_tokens_per_step: int,
                 prefix_caching: bool) -> None:
        self.pool = pool
        self.max_batch, self.budget = max_batch, max_tokens_per_step
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def schedule(self) -> list[tuple[Request, int]]:
        """The step's plan: ``(request, n)`` runs ``tokens[computed : computed + n]``;
        decode rows first, then prefill chunks, then newly admitted requests."""
        budget, plan, paused = self.budget, [], self.preemptions
        for request in list(self.running):
            if request.pending == 1 and request in self.running and budget \
                    and self._make_room(request):
                plan.append((request, 1))
                budget -= 1
        for request in self.running:
            if request.pending > 1 and budget:
                n = min(request.pending, budget)
                plan.append((request, n))
                budget -= n
        # after a pause, pages are short: admitting now would only pause someone again
        while self.waiting and budget and len(self.running) < self.max_batch \
                and self.preemptions == paused and self._admit(self.waiting[0]):
            request = self.waiting.popleft()
            self.running.append(request)
            n = min(request.pending, budget)
            plan.append((request, n))
            budget -= n
        return plan

    def advance(self, request: Request, n: int) -> None:
        """``n`` more tokens of ``request`` are stored; its newly full pages join the prefix
        cache."""
        request.computed += n
        if not self.prefix_caching:
            return
        full = request.computed // self.pool.page_size
        if full > len(request.hashes):
            request.hashes = page_hashes(request.tokens, self.pool.page_size, full,
                                         known=request.hashes)
            for page, page_hash in zip(request.table[:full], request.hashes):
                self.pool.register(page, page_hash)

    def finish(self, request: Request) -> None:
        """Take ``request`` out (running or waiting) and release its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _admit(self, request: Request) -> bool:
        """Give ``request`` its prefix pages and pages for the rest of its tokens + 1, if the
        pool has them; else leave it waiting."""
        ps, pool = self.pool.page_size, self.pool
        # the last token is always run, for its logits: at most (T - 1) // page pages shared
        hashes = (page_hashes(request.tokens, ps, (len(request.tokens) - 1) // ps)
                  if self.prefix_caching else [])
        shared = pool.match(hashes)
        needed = -(-(len(request.tokens) + 1) // ps) - len(shared)
        idle_shared = sum(pool.refcount[page] == 0 for page in shared)
        if pool.available - idle_shared < needed:
            return False
        pool.share(shared)
        request.table = shared + pool.allocate(needed)
        request.computed = len(shared) * ps
        request.hashes = hashes[:len(shared)]
        return True

    def _make_room(self, request: Request) -> bool:
        """A page for ``request``'s next slot, pausing the newest requests while none is
        available; False when ``request`` paused itself."""
        while len(request.table) * self.pool.page_size < request.computed + 1:
            if self.pool.available:
                request.table += self.pool.allocate(1)
                continue
            newest = self.running.pop()
            self._release(newest)
            self.waiting.appendleft(newest)
            self.preemptions += 1
            if newest is request:
                return False
        return True

    def _release(self, request: Request) -> None:
        self.pool.release(request.table)
        request.table, request.computed, request.hashes = [], 0, []
