"""What a request asks of the engine (``SamplingParams``) and what the engine reports back
(``TokenEvent``, ``QueueFull``), checked when they are made so that the server can answer a
bad request with the field's name before anything is queued."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from attnlab._checks import is_int, is_number
from attnlab.generation.logprobs import check_top_logprobs
from attnlab.generation.processors import FREQUENCY_RANGE, LOGIT_BIAS_RANGE

__all__ = ["MAX_SPECULATIVE_TOKENS", "QueueFull", "SamplingParams", "Speculation", "TokenEvent",
           "TokenLogprobs"]

# The most drafts one verification takes: with the token before them, one decoding kernel's
# rows (attnlab.kernels.rule.DECODING_ROWS), so a request verifies in one forward.
MAX_SPECULATIVE_TOKENS = 31


@dataclass(frozen=True)
class SamplingParams:
    """How to extend one prompt.

    ``max_tokens`` new tokens at most (``>= 1``); ``temperature`` ``0`` is greedy (argmax),
    else tokens are drawn from ``softmax(top_p(top_k(logits / temperature)))``
    (``attnlab.generation.sampling``; ``top_k = 0`` and ``top_p = 1`` are off); ``seed``
    gives the request its own ``torch.Generator``, so that the same seed draws the same
    tokens whatever else runs in the batch; a token of ``stop_token_ids`` ends the request
    (it is reported, with ``finish_reason="stop"``); requests of one ``group`` (the ``n``
    choices of one HTTP request) share one fair share of the engine (``None``: the request
    is a group alone; see ``attnlab.serving.scheduler``); ``speculation``: speculative
    decoding (``Speculation``; None: one token a step), which never changes greedy tokens.

    OpenAI's controls, per request inside the batch (``attnlab.serving.request_logits``, in
    ``generate``'s order): ``repetition_penalty`` (CTRL, ``> 0``, 1 = off; prompt and new
    tokens), ``presence_penalty`` / ``frequency_penalty`` (``[-2, 2]``, on the new tokens),
    ``logit_bias`` (token id -> ``[-100, 100]``), the mask of ``json_schema`` (a JSON Schema
    object, enforced by ``attnlab.generation.grammar``; the request ends with a stop token
    once the value is complete), then ``min_p`` (``[0, 1]``, 0 = off) with the sampling
    filters. ``logprobs=k`` (``0..20``) reports with each token its log-probability and the
    ``k`` most likely ones, before any processor (``TokenLogprobs``); ``prompt_logprobs``
    (with ``logprobs``) adds the prompt's, on the first token's event.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    group: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    json_schema: Mapping | None = None
    speculation: Speculation | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature, finite=True) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite float >= 0 (0 = greedy), got "
                             f"{self.temperature!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed: expected None or an int in [-2**63, 2**64) (torch's "
                             f"range), got {self.seed!r}")
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list)) \
                or not all(is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids: expected a tuple of token ids (ints >= 0), got "
                             f"{stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        if self.group is not None and (not isinstance(self.group, str) or not self.group):
            raise ValueError(f"group: expected None or a non-empty str, got {self.group!r}")
        if self.speculation is not None and not isinstance(self.speculation, Speculation):
            raise TypeError(f"speculation: expected a Speculation or None, got "
                            f"{type(self.speculation).__name__}")
        self._check_controls()

    def _check_controls(self) -> None:
        """The OpenAI controls' ranges (the vocabulary is the engine's to check)."""
        lo, hi = FREQUENCY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value, finite=True) or not lo <= value <= hi:
                raise ValueError(f"{name}: expected a number in [{lo:g}, {hi:g}], got "
                                 f"{value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias: expected None or a mapping of token id -> "
                                 f"bias, got {self.logit_bias!r}")
            lo, hi = LOGIT_BIAS_RANGE
            for token, value in self.logit_bias.items():
                if not is_int(token) or token < 0 or not is_number(value, finite=True) \
                        or not lo <= value <= hi:
                    raise ValueError(f"logit_bias: expected token ids (ints >= 0) -> biases "
                                     f"in [{lo:g}, {hi:g}], got {token!r}: {value!r}")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        r = self.repetition_penalty
        if not is_number(r, finite=True) or not r > 0:
            raise ValueError(f"repetition_penalty: expected a finite number > 0 (1 = off), "
                             f"got {r!r}")
        if not is_number(self.min_p, finite=True) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1] (0 = off), got "
                             f"{self.min_p!r}")
        if self.logprobs is not None:
            check_top_logprobs(self.logprobs)
        if not isinstance(self.prompt_logprobs, bool):
            raise ValueError(f"prompt_logprobs: expected a bool, got {self.prompt_logprobs!r}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt_logprobs: the prompt's log-probabilities come with "
                             "logprobs=k (the alternatives per token); got logprobs=None")
        if self.json_schema is not None and not isinstance(self.json_schema, Mapping):
            raise ValueError(f"json_schema: expected None or a JSON Schema object (a mapping), "
                             f"got {type(self.json_schema).__name__}")

    @functools.cached_property  # asked once a token: computed once a request
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability (``logprob``; NaN: none, as for a prompt's first token)
    and its ``k`` most likely alternatives (``top_ids``, ``top_logprobs``, most likely
    first): ``log_softmax`` of the model's logits before any processor."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def none(cls) -> TokenLogprobs:
        """The entry of a token without a value (the prompt's first)."""
        return cls(math.nan)


@dataclass(frozen=True)
class TokenEvent:
    """One thing that happened to a request in a step: a new ``token_id``, with
    ``finish_reason`` ``None`` while it runs and ``"stop"`` (a stop token, reported) or
    ``"length"`` (``max_tokens`` reached) on its last token; or ``token_id=None`` with
    ``"abort"`` when it ended without a token (``Engine.abort``, or an ``error``, whose
    message is then given). With ``SamplingParams.logprobs``: the token's ``logprobs``, and
    on the first token's event with ``prompt_logprobs``, the prompt's (one per prompt
    token)."""

    request_id: str
    token_id: int | None
    finish_reason: str | None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class QueueFull(RuntimeError):  # noqa: N818 (the name the HTTP layer codes against)
    """``Engine.add_request`` when ``max_queue`` requests are waiting already (HTTP 429)."""


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding for one request (``attnlab.serving.speculation``): ``method``
    ``"ngram"`` (prompt lookup over the prompt, the output and ``reference``), ``"self"``
    (a draft of the model's own first ``layers`` layers) or ``"draft"`` (the engine's draft
    model); up to ``num_tokens`` drafts are
    verified in each step. ``reference``: the token ids of an expected output (OpenAI's
    ``prediction``), searched by the lookup as if they were part of the prompt."""

    method: str = "ngram"
    num_tokens: int = 10
    layers: int | None = None
    reference: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "self", "draft"):
            raise ValueError(f"speculative: expected 'ngram', 'self:N' or 'draft', got "
                             f"{self.method!r}")
        if not is_int(self.num_tokens) or not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens: expected an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {self.num_tokens!r}")
        if (self.method == "self") != (self.layers is not None) or (
                self.layers is not None and (not is_int(self.layers) or self.layers < 1)):
            raise ValueError(f"speculative: expected self:N with an int N >= 1 (the draft's "
                             f"layers), or ngram without layers; got method={self.method!r}, "
                             f"layers={self.layers!r}")
        ref = self.reference
        if not isinstance(ref, (tuple, list)) or not all(is_int(t) and t >= 0 for t in ref):
            raise ValueError(f"prediction: expected a tuple of token ids (ints >= 0), got "
                             f"{ref!r}")
        if ref and self.method != "ngram":
            raise ValueError(f"prediction: a predicted output is looked up by ngram "
                             f"speculation; expected no prediction with {self.method}:N")
        object.__setattr__(self, "reference", tuple(ref))
