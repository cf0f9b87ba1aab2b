"""Speculative decoding in the engine: a decoding request proposes ``k`` tokens and one step
checks them all, so one read of the weights can yield up to ``k + 1`` tokens.

A decoding request runs its last token ``x`` at position ``c`` (``c = computed``). With
drafts ``d_1..d_k`` (``SamplingParams.speculation``: prompt lookup, the model's own first
layers, or the server's draft model; ``attnlab.generation.proposers``), it runs ``1 + k``
rows instead, each a *decode row* of its own (``PagedRow(table, c + i, [token])``, one new
token at position ``c + i``):

    rows      x@c     d_1@c+1   ..   d_k@c+k                   keys written: c .. c+k
    logits    row 0   row 1     ..   row k                     row i: the token after d_i

Why decode rows and not a prefill chunk of ``1 + k`` tokens: a decode row is what plain
decoding runs for that position, so it goes through the same kernels (the batch-invariant
linear kernel of up to ``DECODING_ROWS`` rows, decode attention over the request's pages,
the same ``lm_head`` call); every layer writes all the step's keys before any row attends,
so row ``i`` sees ``d_1..d_(i-1)`` as a plain step would after accepting them. Row ``i``'s
logits are then exactly those that plain decoding would compute after accepting ``d_1..d_i``
(``tests/serving/test_engine_speculation.py`` checks it bit for bit, alone and beside other
requests).

Verification (``attnlab.generation.speculative``): greedy keeps the longest prefix of drafts
equal to the rows' argmax, then the argmax after it (so greedy text is the same with
speculation on or off); sampling keeps ``d_i`` with probability ``min(1, p(d_i) / q(d_i))``
and draws from ``norm(max(0, p - q))`` at the first rejection, with the request's generator
(the same distribution as plain sampling; another stream of draws). The accepted drafts'
keys stay; the pages taken for the rejected ones are given back to the pool (``settle``).
A model draft (``self:N``, or ``draft``: a smaller model sharing the tokenizer, loaded once
with the engine) keeps a dense KV cache per speculating request
(``attnlab.generation.proposers.DraftModel``), outside the pool, of the request's prompt and
new tokens. Its memory is bounded: at most ``max_requests`` such caches live at once (a step
speculates with at most that many requests); making one more drops the least recently used,
whose request, if it speculates again, refills a new one from its tokens (one draft forward
over them; the tokens are the same either way). A cache is also dropped with its request.
So the caches take at most ``max_requests x max_request_tokens`` positions of the draft's
layers (``self:N``: ``N / layers`` of the model's keys for a full context, each).

When it runs: a request asks for it (``SamplingParams.speculation``); the engine speculates
in a step only when at most ``max_requests`` requests decode in it (with many sharing a step
the model's weights are read once for all of them anyway, and verifying drafts costs more
than it saves: llama.cpp measured 0.77x with 8 slots), within the step's token budget and one
decoding kernel's rows. Either way greedy tokens are the same and sampled ones follow the
same distribution; but a seeded sampled request draws differently in a step that verifies
drafts, so its text, unlike plain sampling's, may change with the load. ``stats`` counts
what it did.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.generation import check_logits, sampling_probs
from attnlab.generation.proposers import DraftModel, Draw, PromptLookup, Proposer, early_exit
from attnlab.generation.speculative import accept_greedy, accept_sampled
from attnlab.kernels.rule import DECODING_ROWS
from attnlab.models import DecoderLM
from attnlab.serving.paged_cache import PagePool
from attnlab.serving.params import Speculation
from attnlab.serving.runner import PagedRow
from attnlab.serving.scheduler import Request

__all__ = ["Drafts", "Speculator", "refuse_with_speculation", "requested",
           "speculation_from", "split_draft"]

# Requests decoding in a step above which no request speculates in it (module docstring).
DEFAULT_MAX_REQUESTS = 2
# Drafts a verification takes when the request does not say: prompt lookup's are free to
# make (transformers' examples use 10), a model draft's cost a forward each (its default 5).
DEFAULT_TOKENS = {"ngram": 10, "self": 5, "draft": 5}


def speculation_from(text: str, num_tokens: int | None = None,
                     reference: tuple[int, ...] = ()) -> Speculation:
    """``Speculation`` for ``speculative`` as a request or ``attnlab serve --speculative``
    names it: ``ngram``, ``ngram:K``, ``self:N`` or ``draft`` (the server's draft model,
    ``draft:FOLDER`` on its command line: ``split_draft``), with ``num_tokens`` drafts (None:
    ``K``, else ``DEFAULT_TOKENS``); ``reference``: a predicted output's ids (``prediction``)."""
    if not isinstance(text, str):
        raise ValueError(f"speculative: expected ngram, ngram:K, self:N or draft, got {text!r}")
    method, _, value = text.partition(":")
    count = int(value) if value.isdigit() else 0
    if method not in ("ngram", "self", "draft") or (value and count < 1) or (
            method == "self" and not count) or (method == "draft" and value):
        extra = " (draft:FOLDER loads a draft model when the server starts: attnlab serve " \
            "--speculative draft:FOLDER; a request then asks for draft)" \
            if method == "draft" else ""
        raise ValueError(f"speculative: expected ngram, ngram:K, self:N with ints K, N >= 1, "
                         f"or draft{extra}, got {text!r}")
    if num_tokens is None:
        num_tokens = count if method == "ngram" and count else DEFAULT_TOKENS[method]
    return Speculation(method, num_tokens, count if method == "self" else None, reference)


def split_draft(text: str) -> str | None:
    """The folder of a server's ``--speculative draft:FOLDER`` (None for another choice)."""
    method, _, folder = text.partition(":")
    if method != "draft":
        return None
    if not folder:
        raise ValueError(f"speculative: expected draft:FOLDER (the draft model's checkpoint "
                         f"folder) for a server's default, got {text!r}")
    return folder


# Request fields that speculative decoding does not serve yet -> the values that leave them
# off. A request that sets one beside `speculative` or `prediction` is refused naming it.
_REFUSED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0),
            "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
            "repetition_penalty": (None, 1), "logit_bias": (None, {}),
            "min_p": (None, 0), "echo": (None, False),
            "response_format": (None, {"type": "text"}), "tools": (None, []),
            "n": (None, 1)}


def refuse_with_speculation(body: object) -> str | None:
    """The first field of a request ``body`` (an object with the fields as attributes) that
    speculative decoding cannot serve with it (logprobs, penalties, a grammar, ``n > 1``), or
    None when there is none."""
    for name, harmless in _REFUSED.items():
        if getattr(body, name, None) not in harmless:
            return name
    return None


def requested(body: object, default: Speculation | None,
              reference: tuple[int, ...] = ()) -> Speculation | None:
    """The speculation a request ``body`` gets: what its ``speculative`` and
    ``num_speculative_tokens`` ask for, prompt lookup over ``reference`` (the tokens of its
    ``prediction``) when it gives one, else the server's ``default`` where the request uses
    nothing that speculation cannot serve. A ``ValueError`` whose message begins with the
    field's name refuses a bad value or a field that cannot be combined with it."""
    asked = getattr(body, "speculative", None)
    num_tokens = getattr(body, "num_speculative_tokens", None)
    if asked is None and not reference:
        if num_tokens is not None:
            raise ValueError(f"num_speculative_tokens: only with speculative (ngram, ngram:K, "
                             f"self:N or draft) or prediction, got {num_tokens} without them")
        return default if refuse_with_speculation(body) is None else None
    field = refuse_with_speculation(body)
    if field is not None:
        why = "speculative" if asked is not None else "prediction"
        raise ValueError(f"{field}: not served with speculative decoding ({why}) yet; "
                         f"expected it left out, or no {why}")
    return speculation_from("ngram" if asked is None else asked, num_tokens, reference)


@dataclass(frozen=True)
class Drafts:
    """A request's proposal for one step: ``tokens`` ``k`` and the distribution ``q``
    ``k x V`` they were drawn from (None: one-hot, a deterministic guess)."""

    tokens: list[int]
    q: Tensor | None


@dataclass
class SpeculationStats:
    """What speculation did: ``verifications`` (request-steps that checked drafts),
    ``proposed`` and ``accepted`` drafts, ``tokens`` that verifications yielded, and
    ``switched_off`` steps where requests asked for it but too many decoded together."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0
    switched_off: int = 0


class Speculator:
    """The engine's speculative decoding: proposals for a step's decoding requests, their
    pages, their rows, their verification (module docstring). Called by the engine's stepping
    thread; ``reserve`` and ``settle`` under the engine's lock (they touch the pool).
    ``draft``: the draft model of requests asking for ``draft`` (None: such requests are
    refused), with the model's vocabulary, context and device."""

    def __init__(self, model: DecoderLM, pool: PagePool, budget: int,
                 max_requests: int = DEFAULT_MAX_REQUESTS, draft: DecoderLM | None = None
                 ) -> None:
        if draft is not None:
            _check_draft(model, draft)
        self.model, self.pool, self.budget, self.max_requests = model, pool, budget, max_requests
        self.draft = draft
        self.stats = SpeculationStats()
        # each speculating request's proposer, forgotten with the request
        self._proposers: weakref.WeakKeyDictionary[Request, Proposer] = \
            weakref.WeakKeyDictionary()
        # the requests holding a model draft's cache, least recently used first
        self._caches: list[weakref.ref[Request]] = []

    def check(self, speculation: Speculation | None) -> None:
        """Refuse a ``speculation`` this model cannot run (a draft of too many layers, or a
        draft model that the engine has not)."""
        s = speculation
        if s is not None and s.method == "draft" and self.draft is None:
            raise ValueError("speculative: draft asks for the server's draft model, and this "
                             "server has none; expected ngram, ngram:K or self:N (or a server "
                             "started with --speculative draft:FOLDER)")
        if s is not None and s.layers is not None and s.layers >= self.model.config.num_layers:
            raise ValueError(f"speculative: self:{s.layers} asks for a draft of {s.layers} "
                             f"layers; expected fewer than the model's "
                             f"{self.model.config.num_layers}")

    def propose(self, plan: list[tuple[Request, int]]) -> dict[Request, Drafts]:
        """Drafts for the decoding requests of ``plan`` that ask for them, when at most
        ``max_requests`` requests decode in it; at most ``budget`` tokens in the step and
        ``DECODING_ROWS`` decode rows. Runs the drafts' models, outside the engine's lock."""
        decoding = [r for r, n in plan if n == 1 and r.pending == 1]
        asking = [r for r in decoding if r.params.speculation is not None]
        if not asking:
            return {}
        if len(decoding) > self.max_requests:
            self.stats.switched_off += 1
            return {}
        room = min(self.budget - sum(n for _, n in plan), DECODING_ROWS - len(decoding))
        out = {}
        for request in asking:
            p = request.params
            k = min(p.speculation.num_tokens, p.max_tokens - request.generated - 1, room)
            if k <= 0:
                continue
            drafts = self._propose(request, k)
            if drafts.tokens:
                out[request] = drafts
                room -= len(drafts.tokens)
        return out

    def reserve(self, drafts: dict[Request, Drafts]) -> dict[Request, Drafts]:
        """Pages for each request's drafts (its block table must cover them); drafts that the
        pool has no pages for are cut to the slots the request holds already (never pausing
        another request for a guess). Returns the drafts that will run."""
        ps, out = self.pool.page_size, {}
        for request, d in drafts.items():
            need = -(-(request.computed + 1 + len(d.tokens)) // ps) - len(request.table)
            if need > 0:
                granted = self.pool.allocate(need)
                if granted is not None:
                    request.table += granted.pages
            fits = len(request.table) * ps - request.computed - 1
            if fits < len(d.tokens):
                d = Drafts(d.tokens[:fits], None if d.q is None else d.q[:fits])
            if d.tokens:
                out[request] = d
        return out

    def rows(self, drafts: dict[Request, Drafts]) -> list[PagedRow]:
        """The drafts' decode rows, request after request in ``drafts``' order: draft ``i``
        (from 1) of a request at position ``computed + i`` (the row before it, the request's
        last token at ``computed``, is the step's plain decode row)."""
        return [PagedRow(list(r.table), r.computed + i, [token])
                for r, d in drafts.items() for i, token in enumerate(d.tokens, start=1)]

    def verify(self, request: Request, logits: Tensor, unusable: list[bool], best: list[int],
               drafts: Drafts) -> list[int]:
        """The tokens a verification yields, ``m + 1`` (``m`` accepted drafts, then the
        target's own token): from the logits ``(k + 1) x V`` of the request's rows, which of
        them are ``unusable`` (NaN: ``check_logits`` raises when the rule reads one) and their
        argmax ``best``; greedy or the rejection rule (module docstring)."""
        p, tokens = request.params, torch.tensor(drafts.tokens)
        name = f"logits (request {request.request_id!r})"
        if p.greedy:
            m = accept_greedy(torch.tensor(best), tokens)
            if any(unusable[:m + 1]):
                check_logits(logits[:m + 1], name)
            chosen = [*drafts.tokens[:m], best[m]]
        else:
            if any(unusable):
                check_logits(logits, name)
            probs = sampling_probs(logits.float(), p.temperature, p.top_k or None,
                                   p.top_p if p.top_p < 1 else None, check=False)
            chosen = accept_sampled(probs, drafts.q, tokens.to(probs.device),
                                    request.generator).tolist()
        accepted = len(chosen) - 1
        proposer = self._proposers.get(request)
        if proposer is not None:  # (its draft's cache may have gone to another request)
            proposer.feedback(len(drafts.tokens), accepted)
        s = self.stats
        s.verifications, s.proposed = s.verifications + 1, s.proposed + len(drafts.tokens)
        s.accepted, s.tokens = s.accepted + accepted, s.tokens + len(chosen)
        return chosen

    def settle(self, request: Request) -> None:
        """Give back the pages past what ``request`` needs now (its stored tokens and the one
        it runs next): the pages taken for its rejected drafts."""
        keep = -(-(request.computed + 1) // self.pool.page_size)
        if len(request.table) > keep:
            self.pool.release(request.table[keep:])
            del request.table[keep:]

    def _propose(self, request: Request, k: int) -> Drafts:
        """Up to ``k`` drafts from ``request``'s proposer (made on its first use)."""
        s, ids = request.params.speculation, request.tokens
        proposer = self._proposers.get(request)
        if proposer is None:
            proposer = self._make(request)
            self._proposers[request] = proposer
        if s.method != "ngram":
            self._used(request)
        if s.reference:  # the predicted output, searched as if the prompt held it
            ids = ids[:request.prompt_length] + list(s.reference) + ids[request.prompt_length:]
        tokens, q = proposer.propose(torch.tensor([ids], device=self.model.device), k,
                                     self._draws(request))
        return Drafts([int(t) for t in tokens.tolist()], q)

    def _make(self, request: Request) -> Proposer:
        s = request.params.speculation
        if s.method == "ngram":
            return PromptLookup(s.num_tokens)
        capacity = request.prompt_length + request.params.max_tokens
        draft = self.draft if s.method == "draft" else early_exit(self.model, s.layers)
        return DraftModel(draft, capacity, num_tokens=s.num_tokens, max_tokens=s.num_tokens)

    def _used(self, request: Request) -> None:
        """Mark ``request``'s draft cache the most recently used; drop the least recently
        used ones past ``max_requests`` (module docstring: the bound on their memory)."""
        self._caches = [r for r in self._caches if r() is not None and r() is not request]
        while len(self._caches) >= max(self.max_requests, 1):
            self._proposers.pop(self._caches.pop(0)(), None)
        self._caches.append(weakref.ref(request))

    def _draws(self, request: Request) -> Draw:
        """How a model draft picks its tokens: the request's own rule (argmax, or a draw from
        its filtered softmax with its generator, ``q`` returned for the rejection rule)."""
        p = request.params

        def draw(logits: Tensor) -> tuple[Tensor, Tensor | None]:
            if p.greedy:
                return self.model.greedy(logits), None
            q = sampling_probs(logits.float(), p.temperature, p.top_k or None,
                               p.top_p if p.top_p < 1 else None, check=False)
            return torch.multinomial(q, 1, generator=request.generator)[0], q

        return draw


def _check_draft(model: DecoderLM, draft: DecoderLM) -> None:
    """Refuse a draft model that cannot propose for ``model``'s requests, naming it."""
    if not isinstance(draft, DecoderLM):
        raise TypeError(f"draft_model: expected an attnlab DecoderLM, got "
                        f"{type(draft).__name__}")
    c, d = model.config, draft.config
    if d.vocab_size != c.vocab_size:
        raise ValueError(f"draft_model: expected the model's vocabulary of {c.vocab_size} "
                         f"tokens (a draft shares the tokenizer), got vocab_size="
                         f"{d.vocab_size}")
    if d.max_len < c.max_len:
        raise ValueError(f"draft_model: expected a context of at least the model's max_len="
                         f"{c.max_len} tokens (it drafts for any request), got max_len="
                         f"{d.max_len}")
    if draft.device != model.device:
        raise ValueError(f"draft_model: expected the model's device {model.device}, got "
                         f"{draft.device}")
    if draft.training:
        raise ValueError("draft_model: expected a model in eval mode (model.eval()), got one "
                         "in training mode")
