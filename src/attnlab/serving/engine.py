"""The serving engine: requests in, one token per running request per ``step()`` out.

    add_request(prompt ids, SamplingParams) -> id      checked, queued (QueueFull past max_queue)
    step():  plan (scheduler)  ->  the runner's forward over the pages of the planned
             requests (``runner.ModelRunner.hidden``: every new token in one sequence,
             attention per request, in batch-invariant groups)
             ->  one lm_head call for the requests whose prompt is done (a prefill chunk
             that does not end its prompt needs no logits)  ->  sample each of them
             ->  [TokenEvent(id, token, finish_reason)], pages released on finish

A request asking for speculative decoding (``SamplingParams.speculation``) runs its drafts as
more decode rows of the same forward and may get several tokens a step
(``attnlab.serving.speculation``: the drafts, their pages, their verification).

Everything a request holds is in a ``PagePool`` (``paged_cache``: which pages) and the
``Scheduler``; the ``ModelRunner`` holds the pages' tensors. ``abort`` and an error in the
model release a request the same way as a finish.

Threads: ``add_request``, ``abort``, ``stats`` and ``has_work`` may be called from any
thread (the HTTP layer's event loop); ``step`` from one thread only. A lock guards the
queues and the pool; ``step`` holds it to plan and to record, not while the model runs.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab._checks import check_positive, is_int
from attnlab.generation import check_logits, sample_logits, unusable_rows
from attnlab.models import DecoderLM
from attnlab.serving.paged_cache import PagePool
from attnlab.serving.params import QueueFull, SamplingParams, TokenEvent
from attnlab.serving.request_logits import GrammarCache, RequestLogits, process_rows
from attnlab.serving.runner import ModelRunner, PagedRow
from attnlab.serving.scheduler import Request, Scheduler
from attnlab.serving.speculation import DEFAULT_MAX_REQUESTS, Drafts, Speculator

__all__ = ["DEFAULT_POOL_BYTES", "MIN_REQUEST_TOKENS", "Engine", "QueueFull", "SamplingParams",
           "TokenEvent"]

# Without kv_pages, the pool holds max_batch full contexts but takes at most this much memory
# (a 32k-token context times 8 requests would otherwise take gigabytes up front).
DEFAULT_POOL_BYTES = 2 * 2**30
# A pool must hold one request this long (or the whole context, when it is shorter): a few
# lines of prompt and answer. A smaller pool is refused when the engine is made.
MIN_REQUEST_TOKENS = 16


class Engine:
    """Continuous batching over a paged KV cache for one ``DecoderLM`` (any family, float or
    quantized), in eval mode.

    ``max_batch`` requests run at once; a step runs at most ``max_tokens_per_step`` tokens
    (one per decoding request first, prefill chunks with the rest; ``>= max_batch``);
    ``kv_pages`` pages of ``page_size`` tokens hold every request's keys and values (default:
    ``max_batch`` full contexts, within ``DEFAULT_POOL_BYTES``; a pool that cannot hold one
    request of ``min(max_len, MIN_REQUEST_TOKENS)`` tokens is refused, naming ``kv_pages`` or,
    for the default, the model); a request may then have ``max_request_tokens`` tokens, prompt
    and new ones together; ``max_queue`` requests may wait; ``prefix_caching`` shares the full
    pages of equal prompt prefixes. Requests are scheduled fairly between groups
    (``SamplingParams.group``; see ``attnlab.serving.scheduler``). ``tokenizer`` (an attnlab
    ``Tokenizer``) compiles the grammars of requests with a ``json_schema``; the other
    controls and the logprobs of ``SamplingParams``: ``attnlab.serving.request_logits``.
    Requests asking for speculative decoding speculate in a step where at most
    ``speculate_max_requests`` requests decode (``attnlab.serving.speculation``);
    ``draft_model``: the draft model of those asking for ``draft`` (sharing the tokenizer).
    """

    def __init__(self, model: DecoderLM, *, max_batch: int = 8, max_tokens_per_step: int = 512,
                 kv_pages: int | None = None, page_size: int = 16, max_queue: int = 64,
                 prefix_caching: bool = True, tokenizer: object | None = None,
                 speculate_max_requests: int = DEFAULT_MAX_REQUESTS,
                 draft_model: DecoderLM | None = None) -> None:
        if not isinstance(model, DecoderLM):
            raise TypeError(f"model: expected an attnlab DecoderLM, got {type(model).__name__}")
        if model.training:
            raise ValueError("model: expected a model in eval mode (model.eval(): dropout "
                             "would make the tokens random), got one in training mode")
        c = model.config
        if c.rope_scaling is not None and c.rope_scaling.rope_type == "longrope":
            raise ValueError("model: longrope RoPE changes every cached key once a sequence "
                             "passes original_max_position_embeddings, which the paged cache "
                             "does not recompute; expected another RoPE (use attnlab generate)")
        if c.max_len < 2:
            raise ValueError(f"model: its context max_len={c.max_len} (config.json's "
                             "max_position_embeddings) holds no prompt token with a new one; "
                             "expected at least 2 tokens")
        for name, value in (("max_batch", max_batch), ("page_size", page_size),
                            ("max_queue", max_queue),
                            ("max_tokens_per_step", max_tokens_per_step)):
            check_positive(name, value)
        if page_size > c.max_len:
            raise ValueError(f"page_size: expected at most the model's max_len={c.max_len} "
                             f"tokens (a page larger than a context is never filled), got "
                             f"{page_size}")
        if max_tokens_per_step < max_batch:
            raise ValueError(f"max_tokens_per_step: expected at least max_batch={max_batch} "
                             f"(one decode token per running request), got "
                             f"{max_tokens_per_step}")
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching: expected a bool, got {prefix_caching!r}")
        if not is_int(speculate_max_requests) or speculate_max_requests < 0:
            raise ValueError(f"speculate_max_requests: expected an int >= 0 (0: never "
                             f"speculate), got {speculate_max_requests!r}")
        # the pool must hold one request of a useful length: the context, or at least this
        need = min(c.max_len, MIN_REQUEST_TOKENS)
        if kv_pages is None:
            kv_pages = default_pages(model, max_batch, page_size)
            if kv_pages * page_size < need:
                raise ValueError(
                    f"model: its keys and values take {token_bytes(model)} bytes a token "
                    f"(2 x num_layers={c.num_layers} x kv_heads={c.kv_heads} x "
                    f"head_dim={c.head_dim} in {model.dtype}), so the default pool of "
                    f"{DEFAULT_POOL_BYTES} bytes holds {kv_pages * page_size} tokens; expected "
                    f"room for one request of {need} tokens: set kv_pages (attnlab serve "
                    f"--kv-pages) to allow more memory")
        check_positive("kv_pages", kv_pages)
        if kv_pages * page_size < need:
            raise ValueError(f"kv_pages: {kv_pages} pages of {page_size} tokens hold "
                             f"{kv_pages * page_size} tokens; expected at least "
                             f"{math.ceil(need / page_size)} pages (one request of {need} "
                             f"tokens: the model's context max_len={c.max_len}, or "
                             f"{MIN_REQUEST_TOKENS} when it is longer)")
        self.model, self.max_queue = model, max_queue
        self.pool = PagePool(kv_pages, page_size)
        self.runner = ModelRunner(model, kv_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_batch=max_batch,
                                   max_tokens_per_step=max_tokens_per_step,
                                   prefix_caching=prefix_caching)
        self.speculator = Speculator(model, self.pool, max_tokens_per_step,
                                     speculate_max_requests, draft_model)
        self._lock = threading.Lock()
        self._stepping = threading.Lock()
        self._live: dict[str, Request] = {}
        # the request objects, not their ids: an id reused after a finish is another request
        self._aborts: list[Request] = []
        self._tokens_generated = 0
        self.grammars = GrammarCache(tokenizer, c.vocab_size)
        self._controls: dict[Request, RequestLogits] = {}

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; return its id (``request_id``, or a new unique one).

        ``prompt_ids``: a non-empty list of token ids in ``[0, V)``. A ``ValueError`` names
        ``max_tokens`` when the prompt + ``max_tokens`` exceeds the model's context
        (``config.max_len``) or the whole pool, ``prompt_ids`` when the prompt alone does;
        ``QueueFull`` when ``max_queue`` requests are waiting.
        """
        c, ps = self.model.config, self.pool.page_size
        prompt = _token_list(prompt_ids, c.vocab_size)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
        for i, t in enumerate(params.stop_token_ids):
            if t >= c.vocab_size:
                raise ValueError(f"stop_token_ids[{i}]: expected a token id in "
                                 f"[0, {c.vocab_size}), got {t}")
        self.speculator.check(params.speculation)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise TypeError(f"request_id: expected a non-empty str or None, got {request_id!r}")
        size, n = len(prompt), params.max_tokens
        limit = self.max_request_tokens
        what = (f"the model's context is max_len={c.max_len} tokens" if limit == c.max_len
                else f"the KV cache holds {limit} tokens ({self.pool.num_pages} pages of {ps})")
        if size >= limit:
            raise ValueError(f"prompt_ids: the prompt has {size} tokens and {what}, which "
                             f"leaves no room for a new token (at most {limit - 1} prompt tokens)")
        if size + n > limit:
            raise ValueError(f"max_tokens: the prompt has {size} tokens and {what}, so at most "
                             f"{limit - size} new tokens fit; got {n}")
        controls = self._request_logits(params, size)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        with self._lock:
            request_id = uuid.uuid4().hex if request_id is None else request_id
            if request_id in self._live:
                raise ValueError(f"request_id: {request_id!r} is running or waiting already; "
                                 "expected a new id")
            if len(self.scheduler.waiting) >= self.max_queue:
                raise QueueFull(f"max_queue: {self.max_queue} requests are waiting already")
            request = Request(request_id, prompt, size, params, generator)
            self.scheduler.add(request)
            self._live[request_id] = request
            if controls is not None:
                self._controls[request] = controls
        return request_id

    def _request_logits(self, params: SamplingParams, prompt_length: int
                        ) -> RequestLogits | None:
        """The request's processors and logprobs (``None`` when it asks for neither), its
        token ids checked against the vocabulary and its schema compiled (``ValueError``s
        naming ``logit_bias`` or ``json_schema``)."""
        vocab = self.model.config.vocab_size
        for token in params.logit_bias or ():
            if token >= vocab:
                raise ValueError(f"logit_bias: expected token ids in [0, {vocab}) (the "
                                 f"model's vocabulary) as keys, got {token}")
        grammar = (None if params.json_schema is None
                   else self.grammars.get(params.json_schema, params.stop_token_ids))
        controls = RequestLogits(params, prompt_length, vocab, grammar)
        if not controls.active and params.logprobs is None:
            return None
        return controls

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + ``max_tokens``) one request may have: the model's context
        or the whole pool, the smaller."""
        return min(self.model.config.max_len, self.pool.num_pages * self.pool.page_size)

    def abort(self, request_id: str) -> None:
        """End a request (waiting or running): the next ``step`` releases its pages and reports
        ``TokenEvent(request_id, None, "abort")``. An id that is not live (finished already,
        never added) is ignored: a client may disconnect after its last token."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a str, got {type(request_id).__name__}")
        with self._lock:
            request = self._live.get(request_id)
            if request is not None:
                self._aborts.append(request)

    def has_work(self) -> bool:
        """Whether a ``step`` would do anything: requests waiting or running, aborts to
        report."""
        with self._lock:
            return bool(self._live or self._aborts)

    def stats(self) -> dict[str, int | float]:
        """``running``, ``waiting``, ``pages_used``, ``pages_total``, ``pages_cached`` (in the
        prefix cache, used or idle), ``prefix_hits`` (pages reused), ``tokens_generated``,
        ``preemptions`` (requests paused for lack of pages); speculative decoding's
        ``spec_verifications``, ``spec_proposed``, ``spec_accepted`` (drafts),
        ``spec_switched_off`` (steps), ``spec_acceptance_rate`` (accepted / proposed) and
        ``spec_tokens_per_verification`` (``attnlab.serving.speculation``)."""
        with self._lock:
            s, pool, spec = self.scheduler, self.pool, self.speculator.stats
            return {"running": len(s.running), "waiting": len(s.waiting),
                    "pages_used": pool.used, "pages_total": pool.num_pages,
                    "pages_cached": pool.cached, "prefix_hits": pool.prefix_hits,
                    "tokens_generated": self._tokens_generated, "preemptions": s.preemptions,
                    "spec_verifications": spec.verifications, "spec_proposed": spec.proposed,
                    "spec_accepted": spec.accepted, "spec_switched_off": spec.switched_off,
                    "spec_acceptance_rate": spec.accepted / max(spec.proposed, 1),
                    "spec_tokens_per_verification": (spec.tokens / spec.verifications
                                                     if spec.verifications else 1.0)}

    def step(self) -> list[TokenEvent]:
        """One scheduler step: report aborts, admit, run a prefill chunk or a decode token of
        every planned request in one forward, sample, retire finished requests.

        A ``RuntimeError`` when another thread is in ``step`` already (one stepping thread).
        """
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("step: another thread is running step(); expected one "
                               "stepping thread")
        try:
            return self._step()
        finally:
            self._stepping.release()

    def _step(self) -> list[TokenEvent]:
        with self._lock:
            events = self._take_aborts()
            plan = self.scheduler.schedule()
        # The speculator only in a step where a request asks for drafts (most steps: none);
        # outside the lock: a draft model may run.
        asking = any(r.params.speculation is not None for r, _ in plan)
        drafts = self.speculator.propose(plan) if asking else {}
        with self._lock:
            rows = [PagedRow(list(r.table), r.computed, r.tokens[r.computed:r.computed + n])
                    for r, n in plan]
            if drafts:
                drafts = self.speculator.reserve(drafts)
                rows += self.speculator.rows(drafts)
        if plan:
            ended, ready = self._run(plan, rows, drafts)
            events += ended
            if ready:
                events += self._sample(ready, drafts)
        return events

    def _run(self, plan: list[tuple[Request, int]], rows: list[PagedRow],
             drafts: dict[Request, Drafts]
             ) -> tuple[list[TokenEvent], list[tuple[Request, Tensor]]]:
        """The runner's forward over ``rows`` (``plan``'s, then the ``drafts``' rows); record
        it. Returns the events of the requests it ended (a failure ends these requests, with
        the error, not the engine) and, for each request whose prompt is now done, the
        request and its last hidden states ``n x E`` (one, or one more than its drafts)."""
        every = [i for i, (request, _) in enumerate(plan) if self._wants_prompt(request)]
        try:
            with torch.inference_mode():
                states = self.runner.hidden_states(rows, every)
                for i in every:
                    request = plan[i][0]
                    self._controls[request].record_prompt(states[i], rows[i].start,
                                                          request.tokens, self.runner.logits)
                last = torch.stack([h[-1] for h in states])
        except Exception as error:
            with self._lock:
                return [self._end(request, f"{type(error).__name__}: {error}")
                        for request, _ in plan], []
        done, extra = [], len(plan)  # the drafts' rows follow the plan's, in drafts' order
        with self._lock:
            for i, (request, n) in enumerate(plan):
                self.scheduler.advance(request, n)
                if request.pending == 0:
                    k = len(drafts[request].tokens) if request in drafts else 0
                    done.append((request, last[[i, *range(extra, extra + k)]]))
                    extra += k
        return [], done

    def _sample(self, ready: list[tuple[Request, Tensor]], drafts: dict[Request, Drafts]
                ) -> list[TokenEvent]:
        """The next token of each request of ``ready`` from its last hidden state (or tokens,
        from the states of its drafts' rows too): one ``lm_head`` call (the largest weight,
        read once a step) and one read-back for them all. A failure ends these requests, not
        the engine."""
        try:
            with torch.inference_mode():
                raw = logits = self.runner.logits(torch.cat([h for _, h in ready]))
                if self._controls:  # some request asks for processors or logprobs
                    # A request with drafts has no controls (the server refuses the two
                    # together).
                    controls, tokens = [], []
                    for request, hidden in ready:
                        n = hidden.shape[0]
                        controls += [self._controls.get(request) if n == 1 else None] * n
                        tokens += [request.tokens] * n
                    logits = process_rows(controls, tokens, raw)
            unusable, best = unusable_rows(logits).tolist(), self.model.greedy(logits).tolist()
        except Exception as error:
            with self._lock:
                return [self._end(request, f"{type(error).__name__}: {error}")
                        for request, _ in ready]
        events, i = [], 0
        with self._lock:
            for request, hidden in ready:
                n = hidden.shape[0]
                if request in drafts:
                    events += self._verified(request, logits[i:i + n], unusable[i:i + n],
                                             best[i:i + n], drafts[request])
                else:
                    events.append(self._next_token(request, logits[i], unusable[i], best[i],
                                                    raw[i]))
                i += n
        return events

    def _verified(self, request: Request, logits: Tensor, unusable: list[bool],
                  best: list[int], drafts: Drafts) -> list[TokenEvent]:
        """``request``'s tokens of a verification (``Speculator.verify``), reported one by
        one as plain decoding would, up to the first that ends it; the accepted drafts' keys
        kept, the pages of the rejected ones released."""
        try:
            tokens = self.speculator.verify(request, logits, unusable, best, drafts)
        except Exception as error:  # NaN logits, or a sampler failure: this request only
            return [self._end(request, f"{type(error).__name__}: {error}")]
        events = []
        for token in tokens:
            events.append(self._append(request, token))
            if events[-1].finish_reason is not None:
                return events
        self.scheduler.advance(request, len(tokens) - 1)  # the accepted drafts are stored
        self.speculator.settle(request)
        return events

    def _take_aborts(self) -> list[TokenEvent]:
        events = [self._end(request, None) for request in dict.fromkeys(self._aborts)
                  if self._live.get(request.request_id) is request]
        self._aborts.clear()
        return events

    def _wants_prompt(self, request: Request) -> bool:
        controls = self._controls.get(request)
        return controls is not None and controls.wants_prompt \
            and request.computed < request.prompt_length

    def _next_token(self, request: Request, logits: Tensor, unusable: bool,
                    best: int, raw: Tensor) -> TokenEvent:
        """Choose ``request``'s next token from its processed logits ``V`` (``unusable``: no
        token can be chosen from them; ``best``: their argmax; ``raw``: the model's, for the
        logprobs); end it if it is done."""
        p = request.params
        controls = self._controls.get(request)
        try:
            if unusable:
                check_logits(logits, f"logits (request {request.request_id!r})")  # raises
            if p.greedy:
                token = best
            else:
                token = int(sample_logits(logits, p.temperature, p.top_k or None,
                                          p.top_p if p.top_p < 1 else None, request.generator,
                                          check=False, min_p=p.min_p or None))
            logprobs = prompt = None
            if controls is not None:
                logprobs, prompt = controls.token_logprobs(raw, token), controls.take_prompt()
                controls.advance(token)
        except Exception as error:  # NaN logits, or a sampler failure: this request only
            return self._end(request, f"{type(error).__name__}: {error}")
        return self._append(request, token, logprobs, prompt)

    def _append(self, request: Request, token: int, logprobs: object = None,
                prompt: object = None) -> TokenEvent:
        """Add ``token`` to ``request``; end it if it is done (a stop token, ``max_tokens``);
        its event carries the ``logprobs`` (and the ``prompt``'s) when the request asked."""
        p = request.params
        request.tokens.append(token)
        self._tokens_generated += 1
        reason = ("stop" if token in p.stop_token_ids
                  else "length" if request.generated >= p.max_tokens else None)
        if reason is not None:
            self.scheduler.finish(request)
            del self._live[request.request_id]
            self._controls.pop(request, None)
        return TokenEvent(request.request_id, token, reason, logprobs=logprobs,
                          prompt_logprobs=prompt)

    def _end(self, request: Request, error: str | None) -> TokenEvent:
        """Abort ``request`` (released, forgotten); its event carries ``error`` if any."""
        self.scheduler.finish(request)
        del self._live[request.request_id]
        self._controls.pop(request, None)
        return TokenEvent(request.request_id, None, "abort", error)


def default_pages(model: DecoderLM, max_batch: int, page_size: int) -> int:
    """Pages for ``max_batch`` full contexts, at most ``DEFAULT_POOL_BYTES`` of keys and
    values (``0`` when one page takes more)."""
    context = math.ceil(model.config.max_len / page_size)
    return min(max_batch * context, DEFAULT_POOL_BYTES // (page_size * token_bytes(model)))


def token_bytes(model: DecoderLM) -> int:
    """Bytes of keys and values that one token takes in the pool: ``2 x layers x G x D`` in
    the model's dtype."""
    c = model.config
    return 2 * c.num_layers * c.kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8


def _token_list(prompt_ids: object, vocab_size: int) -> list[int]:
    """``prompt_ids`` as a list of ints when it is a non-empty sequence of ids in ``[0, V)``."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise TypeError(f"prompt_ids: expected a list of token ids, got "
                        f"{type(prompt_ids).__name__}")
    if not prompt_ids:
        raise ValueError("prompt_ids: expected at least one token id, got an empty list")
    bad = [t for t in prompt_ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: expected ints in [0, {vocab_size}) (the model's "
                         f"vocabulary), got {bad[:5]!r}")
    return list(prompt_ids)

