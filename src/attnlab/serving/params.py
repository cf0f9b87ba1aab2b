"""What a request asks of the engine (``SamplingParams``) and what the engine reports back
(``TokenEvent``, ``QueueFull``), checked when they are made so that the server can answer a
bad request with the field's name before anything is queued."""

from __future__ import annotations

from dataclasses import dataclass

from attnlab._checks import is_int, is_number

__all__ = ["QueueFull", "SamplingParams", "TokenEvent"]


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
    is a group alone; see ``attnlab.serving.scheduler``); ``json_schema``: the JSON Schema
    every token keeps the text a prefix of (``attnlab.generation.grammar``; ``None``: free
    text).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    group: str | None = None
    json_schema: dict | None = None

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
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema: expected None or a JSON Schema (a dict), got "
                             f"{type(self.json_schema).__name__}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """One thing that happened to a request in a step: a new ``token_id``, with
    ``finish_reason`` ``None`` while it runs and ``"stop"`` (a stop token, reported) or
    ``"length"`` (``max_tokens`` reached) on its last token; or ``token_id=None`` with
    ``"abort"`` when it ended without a token (``Engine.abort``, or an ``error``, whose
    message is then given)."""

    request_id: str
    token_id: int | None
    finish_reason: str | None
    error: str | None = None


class QueueFull(RuntimeError):  # noqa: N818 (the name the HTTP layer codes against)
    """``Engine.add_request`` when ``max_queue`` requests are waiting already (HTTP 429)."""
