"""Continuous batching: which requests run in a step, and how many of their tokens.

Every request is a list of ``tokens`` (prompt, then what it generated) of which ``computed``
have their keys/values in its pages; it runs ``pending = len(tokens) - computed`` tokens
more before the model predicts its next one (``1`` once decoding, the rest of the prompt
while prefilling). Requests belong to *groups* (``SamplingParams.group``: the ``n`` choices
of one HTTP request; a request without one is a group alone); ``r_g`` is the number of group
``g``'s requests running. A step, under a budget of ``max_tokens_per_step`` tokens:

1. admit: waiting requests in *fair order*, fewest running of their group first (smallest
   ``r_g``), then first come first served, while fewer than ``max_batch`` run and the pool
   has the pages for the request's tokens + 1 beside the pages the decoding requests need
   this step (its prefix pages found in the prefix cache are shared, not counted). When the
   first request in that order does not fit, the newest request of the group with the most
   running (``r_h``) is paused to make way for it, as long as ``r_h >= r_g + 2``: a group
   never holds two slots more than a group that waits for one, and pausing can never
   swing back (after it, ``r_h - 1 >= r_g + 1``). Admission stops at the first request
   that does not fit, so a large request is not overtaken forever;
2. decode: every running request with one pending token gets it; its next slot may need a
   new page;
3. prefill: the rest of the budget goes to the running requests still prefilling, in
   *prefill order* (fewest running of their group first, then fewest pending tokens, then
   first come): each first gets a floor of ``max(1, max_tokens_per_step // (4 * max_batch))``
   tokens (or what it needs, if less; the floors take at most a quarter of the budget), then
   the tokens left go in that order, each taking what it needs (``prefill_shares``).
   Shortest-first brings the most first tokens soonest (a short chat turn is not held up
   behind a long document, and prompts that arrive together finish one by one instead of all
   at the end of an equal split), and the floor bounds how long any prompt waits: one of
   ``P`` tokens is stored within ``ceil(P / floor)`` steps of running, whatever arrives after
   it. A long prompt takes several steps and never stalls the decoding requests.

Since ``max_tokens_per_step >= max_batch``, the floors of the prefilling requests always fit
beside the decode tokens, so every running request gets at least one token of every step. So
a request of a group that runs nothing is admitted and computes its first prompt tokens in
the first step after it arrives, whatever else runs (``n = 16`` choices of 800 tokens),
unless a request of another group that runs nothing arrived before it and waits too, or the
pool cannot hold it even after the pauses the rule allows (it then waits for pages to be
released, as every request does).

When a decoding request needs a page and none is available, the newest request of the group
with the most running is paused: its pages are released (its full pages stay in the prefix
cache, so that it usually finds them again) and it goes back to the waiting requests with
every token it has and its place in the order, to be prefilled again when pages are free. A
request chosen so that is the one needing the page pauses itself. No request is ever cut
short for lack of pages.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from attnlab.serving.paged_cache import PagePool, page_hashes
from attnlab.serving.params import SamplingParams

__all__ = ["Request", "Scheduler", "prefill_shares"]


@dataclass(eq=False)
class Request:
    """One request's state: ``tokens`` (prompt + generated), ``computed`` of them stored in
    the pages of ``table``, the chain ``hashes`` of its full computed pages; ``arrival``, its
    place in first-come order (set by ``Scheduler.add``)."""

    request_id: str
    tokens: list[int]
    prompt_length: int
    params: SamplingParams
    generator: torch.Generator | None
    table: list[int] = field(default_factory=list)
    computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    arrival: int = 0

    @property
    def pending(self) -> int:
        """Tokens to run before the model predicts the next one."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def group(self) -> Hashable:
        """What it shares its fair share with: ``params.group``, else the request alone."""
        return self if self.params.group is None else self.params.group


class Scheduler:
    """The ``waiting`` requests and the ``running`` ones (in admission order) over a
    ``PagePool``; ``schedule()`` plans a step (module docstring), ``advance`` records it."""

    def __init__(self, pool: PagePool, *, max_batch: int, max_tokens_per_step: int,
                 prefix_caching: bool) -> None:
        self.pool = pool
        self.max_batch, self.budget = max_batch, max_tokens_per_step
        self.floor = max(1, max_tokens_per_step // (4 * max_batch))
        self.prefix_caching = prefix_caching
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        """Queue ``request`` as the latest arrival."""
        request.arrival = next(self._arrivals)
        self.waiting.append(request)

    def schedule(self) -> list[tuple[Request, int]]:
        """The step's plan: ``(request, n)`` runs ``tokens[computed : computed + n]``;
        decode rows first, then prefill chunks in prefill order."""
        self._admit_fairly()
        for request in list(self.running):
            if request.pending == 1 and request in self.running:
                self._make_room(request)
        # a pause for a later request's page may have sent back one that had its page already
        plan = [(r, 1) for r in self.running if r.pending == 1]
        counts = Counter(r.group for r in self.running)
        prefilling = sorted((r for r in self.running if r.pending > 1),
                            key=lambda r: (counts[r.group], r.pending, r.arrival))
        shares = prefill_shares(self.budget - len(plan), [r.pending for r in prefilling],
                                self.floor)
        return plan + [(r, n) for r, n in zip(prefilling, shares) if n]

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

    def _fair_key(self) -> Callable[[Request], tuple[int, int]]:
        """The fair order's key: the running count of the request's group, then arrival."""
        counts = Counter(r.group for r in self.running)
        return lambda request: (counts[request.group], request.arrival)

    def _admit_fairly(self) -> None:
        """Admit waiting requests in fair order, pausing over-share requests to make way."""
        while self.waiting:
            request = min(self.waiting, key=self._fair_key())
            while not self._admit(request):
                mine = sum(r.group == request.group for r in self.running)
                victim = self._victim(at_least=mine + 2)
                if victim is None:
                    return
                self._pause(victim)
            self.waiting.remove(request)
            self.running.append(request)

    def _admit(self, request: Request) -> bool:
        """Give ``request`` its prefix pages and pages for the rest of its tokens + 1, if a
        batch slot is free and the pool has them beside the pages that decoding requests
        need this step; else leave it waiting."""
        if len(self.running) >= self.max_batch:
            return False
        ps = self.pool.page_size
        # the last token is always run, for its logits: at most (T - 1) // page pages shared
        # (none for a request that wants its prompt's logprobs: every position is computed)
        hashes = (page_hashes(request.tokens, ps, (len(request.tokens) - 1) // ps)
                  if self.prefix_caching and not request.params.prompt_logprobs else [])
        decoding = sum(r.pending == 1 and len(r.table) * ps < r.computed + 1
                       for r in self.running)
        granted = self.pool.allocate(-(-(len(request.tokens) + 1) // ps), prefix=hashes,
                                     keep=decoding)
        if granted is None:
            return False
        request.table = list(granted.pages)
        request.computed = granted.shared * ps
        request.hashes = hashes[:granted.shared]
        return True

    def _make_room(self, request: Request) -> None:
        """A page for ``request``'s next slot, pausing requests while none is available
        (``request`` itself, when it is the one chosen)."""
        while len(request.table) * self.pool.page_size < request.computed + 1:
            granted = self.pool.allocate(1)
            if granted is not None:
                request.table += granted.pages
                continue
            victim = self._victim(at_least=1)
            self._pause(victim)
            if victim is request:
                return

    def _victim(self, *, at_least: int) -> Request | None:
        """The newest running request of the group with the most running (of the groups
        tied, the one with the newest request), if that group runs ``at_least``."""
        counts = Counter(r.group for r in self.running)
        most = max(counts.values(), default=0)
        if most < at_least:
            return None
        return next(r for r in reversed(self.running) if counts[r.group] == most)

    def _pause(self, request: Request) -> None:
        """Send a running ``request`` back to wait (it keeps its tokens and its arrival)."""
        self.running.remove(request)
        self._release(request)
        self.waiting.append(request)
        self.preemptions += 1

    def _release(self, request: Request) -> None:
        self.pool.release(request.table)
        request.table, request.computed, request.hashes = [], 0, []


def prefill_shares(budget: int, wants: Sequence[int], floor: int) -> list[int]:
    """Split ``budget`` tokens among ``wants`` (in priority order): each first gets
    ``min(w, floor)``, then the tokens left go in order, each taking up to what it still
    wants. ``prefill_shares(10, [2, 26, 26], 3) == [2, 5, 3]``; the scheduler's floor always
    fits (``len(wants) * floor <= budget``), else it raises ``ValueError``.
    """
    shares = [min(w, floor) for w in wants]
    left = budget - sum(shares)
    if left < 0:
        raise ValueError(f"floor: {len(wants)} floors of {floor} tokens exceed the budget "
                         f"of {budget}")
    for i, w in enumerate(wants):
        more = min(w - shares[i], left)
        shares[i] += more
        left -= more
    return shares
