"""``GET /metrics``: the server's counters and the engine's gauges in Prometheus' text format
(version 0.0.4: ``# HELP``, ``# TYPE``, then ``name{label="value"} number`` lines).

Counters only grow (requests by endpoint and status, prompt and generated tokens); gauges are
the engine's state when the page is asked for (requests running = the batch size, requests
waiting = the queue length, KV cache pages in use and in all); speculative decoding's counts
(verifications, drafts proposed and accepted, steps where it was switched off) and the two
ratios they give (acceptance rate, tokens per verification).
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (engine stats key, metric name, type, help)
_ENGINE = (
    ("running", "attnlab_batch_size", "gauge", "Requests in the running batch."),
    ("waiting", "attnlab_queue_length", "gauge", "Requests waiting to be admitted."),
    ("pages_used", "attnlab_kv_pages_used", "gauge", "KV cache pages in use."),
    ("pages_total", "attnlab_kv_pages_total", "gauge", "KV cache pages in all."),
    ("pages_cached", "attnlab_kv_pages_cached", "gauge",
     "KV cache pages held by the prefix cache (in use or idle)."),
    ("prefix_hits", "attnlab_prefix_cache_hits_total", "counter",
     "Prompt pages found in the prefix cache."),
    ("preemptions", "attnlab_preemptions_total", "counter",
     "Requests paused for lack of KV cache pages."),
    ("spec_verifications", "attnlab_spec_decode_verifications_total", "counter",
     "Speculative decoding: a request's drafts checked in a step."),
    ("spec_proposed", "attnlab_spec_decode_draft_tokens_total", "counter",
     "Speculative decoding: draft tokens proposed and checked."),
    ("spec_accepted", "attnlab_spec_decode_accepted_tokens_total", "counter",
     "Speculative decoding: draft tokens accepted."),
    ("spec_switched_off", "attnlab_spec_decode_switched_off_total", "counter",
     "Steps where requests asked for speculative decoding but too many decoded together."),
    ("spec_acceptance_rate", "attnlab_spec_decode_acceptance_rate", "gauge",
     "Speculative decoding: accepted drafts over proposed ones (0 before any)."),
    ("spec_tokens_per_verification", "attnlab_spec_decode_tokens_per_verification", "gauge",
     "Speculative decoding: tokens each verification yielded (1 before any)."),
)


class Metrics:
    """Counters that the request handlers update (from the event loop) and ``render`` reads;
    a lock keeps a page consistent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status) -> n
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated

    def render(self, engine_stats: dict[str, int | float]) -> str:
        """The page: the counters, then each engine stat that ``engine_stats`` holds."""
        with self._lock:
            lines = ["# HELP attnlab_requests_total Requests answered, by endpoint and HTTP "
                     "status.", "# TYPE attnlab_requests_total counter"]
            lines += [f'attnlab_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += _metric("attnlab_prompt_tokens_total", "counter",
                             "Prompt tokens of the requests accepted.", self.prompt_tokens)
            lines += _metric("attnlab_generation_tokens_total", "counter",
                             "Tokens generated and sent.", self.generated_tokens)
        for key, name, kind, text in _ENGINE:
            if key in engine_stats:
                lines += _metric(name, kind, text, engine_stats[key])
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, text: str, value: int | float) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
