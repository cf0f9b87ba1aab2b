"""Serving under load: ``attnlab serve`` driven by concurrent streaming clients.

A random checkpoint shaped like Qwen2-0.5B with 4 layers (``bench.versus``'s ``QWEN2_FULL`` sizes;
``--layers`` changes the depth) and a word-level tokenizer whose tokens ``w0 .. w{V-1}``
cover the model's whole vocabulary (so that every generated id decodes to text and is
streamed as its own server-sent event) are written into a temporary folder. The app of
``attnlab serve`` (``serving.server.create_app`` on that folder) runs under uvicorn on
127.0.0.1, on a free port, in a thread of this process; a fresh server per measurement, so
that no run finds the prompts of another in its prefix cache, each warmed up by one request.

The load generator: ``C`` client threads share one list of requests (seeded: prompt and
output lengths drawn uniformly from ranges, token-id prompts, greedy); each client sends
the next request that no client has taken, streamed (``POST /v1/completions``,
``stream: true`` with the usage chunk), over ``http.client``, and notes when each token
arrives. A run ends when the requests are done or ``--time-limit`` seconds have passed: then
no request is started and the streams still open are closed (the server frees their pages).
``drive(..., cut_after=k)`` also closes each stream once ``k`` tokens have arrived, as a
client that stops reading does.

1. the requests with ``C`` clients for each ``C`` of ``--clients`` (the same requests each
   time; ``C = 1`` is one at a time): output tokens/s = output tokens / wall time, time to
   first token (TTFT, from sending the request) and inter-token latency (ITL, the gaps
   between a request's successive tokens) p50/p95 over all requests / gaps;
2. prefix caching: a shared system prompt (``--system-tokens``, 1,000) + a short user part,
   one request at a time, after a warm-up request with the same system prompt; TTFT with
   prefix caching against a server with ``prefix_caching=False``;
3. the issue's targets, PASS/FAIL: ``--clients``' largest ``C`` >= 5x the tokens/s of one
   at a time; its p95 ITL <= 3x one client's; prefix caching cuts the TTFT p50 >= 3x.

Writes ``serve.md``, ``serve.json`` and ``serve.png`` (``python -m devbench serve`` keeps a
committed table's earlier runs below the new one, each with its machine).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers

from attnlab._checks import check_positive, is_int, is_number
from attnlab.arg_types import non_negative_int, number, positive_int
from attnlab.bench.harness import int_list, machine_info
from attnlab.bench.serve_report import OUTPUT_TOKENS, PROMPT_TOKENS, markdown, plot, targets
from attnlab.bench.versus import QWEN2_FULL, QWEN2_QUICK, random_checkpoint
from attnlab.durable import write_text_atomic
from attnlab.models.hf_loading import SUPPORTED_DTYPES
from attnlab.serving.server import ServerState, create_app

__all__ = ["Job", "Outcome", "Workload", "add_arguments", "drive", "make_jobs", "percentile",
           "prefix_jobs", "run", "serving", "summarize", "write_tokenizer"]

SERVED_NAME = "bench-qwen2"
START_TIMEOUT_S, STOP_TIMEOUT_S = 120.0, 30.0
# How long past the time limit a client may take to notice it (one read of the stream).
GRACE_S = 5.0
MAX_CLIENTS, MAX_REQUESTS, MAX_SECONDS = 1024, 10_000, 86_400.0
# A server-sent event of a token or of the usage is a few hundred bytes.
MAX_LINE_BYTES = 2**20


@dataclass(frozen=True)
class Workload:
    """The requests: ``requests`` with prompt lengths in ``prompt`` and output lengths in
    ``output`` (inclusive ranges); for prefix caching ``prefix_requests`` of a shared
    ``system``-token prompt + a user part of ``user`` tokens, ``prefix_output`` tokens out."""

    requests: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    system: int
    user: tuple[int, int]
    prefix_requests: int
    prefix_output: int


FULL_WORK = dict(user=(16, 48), prefix_requests=8, prefix_output=4)
QUICK_WORK = Workload(requests=8, prompt=(4, 24), output=(2, 8), system=64, user=(2, 6),
                      prefix_requests=3, prefix_output=2)


@dataclass(frozen=True)
class Job:
    """One request: its prompt token ids and ``max_tokens``."""

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it. ``ttft``: seconds from sending it to its first
    token (None if none came); ``gaps``: seconds between its successive tokens; ``tokens``:
    output tokens (the usage chunk's count, else the tokens seen); ``end``: when it ended,
    in seconds from the run's start; ``error``: why it failed (``"cut"``: closed by the
    client, at the time limit or after ``cut_after`` tokens)."""

    ttft: float | None
    gaps: tuple[float, ...]
    tokens: int
    end: float
    error: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnlab bench serve``."""
    parser.add_argument("--clients", type=_clients, default=(1, 4, 16),
                        help="comma-separated numbers of concurrent clients, each once, one "
                        "run each (1: the same requests one at a time; the targets compare "
                        "the most clients with 1)")
    parser.add_argument("--requests", type=_requests, default=48,
                        help="requests per run (the same ones for every number of clients)")
    parser.add_argument("--prompt-tokens", type=_token_range,
                        default=",".join(map(str, PROMPT_TOKENS)),
                        help="LO,HI: each request's prompt length, uniform in [LO, HI]")
    parser.add_argument("--output-tokens", type=_token_range,
                        default=",".join(map(str, OUTPUT_TOKENS)),
                        help="LO,HI: each request's max_tokens, uniform in [LO, HI]")
    parser.add_argument("--max-batch", type=positive_int, default=16,
                        help="the server's --max-batch: requests decoded together at most")
    parser.add_argument("--max-tokens-per-step", type=positive_int, default=128,
                        help="the server's --max-tokens-per-step (prefill chunks + decodes)")
    parser.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default="float32",
                        help="the served model's dtype (the checkpoint is written in float32)")
    parser.add_argument("--extra-memory", action="store_true",
                        help="the server's --extra-memory: oneDNN's packed copies beside the "
                        "weights where they win (batched decoding; up to twice the memory)")
    parser.add_argument("--page-size", type=positive_int, default=16,
                        help="the server's --page-size: tokens per KV cache page")
    parser.add_argument("--layers", type=_layers, default=QWEN2_FULL["num_hidden_layers"],
                        help="decoder layers of the Qwen2-0.5B-shaped model (Qwen2-0.5B: 24)")
    parser.add_argument("--system-tokens", type=positive_int, default=1000,
                        help="length of the shared system prompt of the prefix-caching run")
    parser.add_argument("--time-limit", type=_seconds, default=150.0,
                        help="seconds per run at most (each number of clients, each prefix "
                        "caching setting); then the requests still open are cut")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the requests and of the weights")


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    sizes = QWEN2_QUICK if args.quick else {**QWEN2_FULL, "num_hidden_layers": args.layers}
    work = QUICK_WORK if args.quick else Workload(
        requests=args.requests, prompt=args.prompt_tokens, output=args.output_tokens,
        system=args.system_tokens, **FULL_WORK)
    engine = {"max_batch": args.max_batch, "max_tokens_per_step": args.max_tokens_per_step,
              "page_size": args.page_size}
    _check_options(engine, work, sizes["max_position_embeddings"])
    engine["dtype"], engine["extra_memory"] = args.dtype, args.extra_memory
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: expected a folder (made if missing), got the file {out}")
    out.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(work, sizes["vocab_size"], args.seed)
    warmup, prefixed = prefix_jobs(work, sizes["vocab_size"], args.seed)
    r = {"sizes": sizes, "workload": asdict(work), "engine": engine, "seed": args.seed,
         "time_limit_s": args.time_limit, "quick": args.quick, "runs": [], "prefix": []}
    with tempfile.TemporaryDirectory() as tmp:
        _, r["checkpoint"] = random_checkpoint(tmp, "qwen2", sizes, seed=args.seed)
        write_tokenizer(tmp, sizes["vocab_size"])
        for clients in args.clients:
            print(f"bench serve: {clients} client(s)", flush=True)
            with serving(tmp, **engine) as (url, state):
                drive(url, [Job(warmup.prompt[-8:], 2)], 1, args.time_limit)
                outcomes, wall = drive(url, jobs, clients, args.time_limit)
                r["runs"].append({"clients": clients, **summarize(outcomes, wall),
                                  "engine_stats": state.engine.stats})
        for caching in (True, False):
            print(f"bench serve: prefix caching {'on' if caching else 'off'}", flush=True)
            with serving(tmp, **engine, prefix_caching=caching) as (url, state):
                drive(url, [warmup], 1, args.time_limit)
                outcomes, wall = drive(url, prefixed, 1, args.time_limit)
                r["prefix"].append({"prefix_caching": caching, **summarize(outcomes, wall),
                                    "engine_stats": state.engine.stats})
    r["targets"] = targets(r)
    info = machine_info()
    r["machine"] = info
    write_text_atomic(out / "serve.json", json.dumps(r, indent=2))
    text = markdown(r, info)
    md = out / "serve.md"
    write_text_atomic(md, text)
    plot(out / "serve.png", r, f"attnlab serve, Qwen2-0.5B shape ({sizes['num_hidden_layers']}"
         f" layers), on {info['cpu']}")
    print(text)
    for target in r["targets"]:
        print(f"{target['result']}: {target['target']} (measured {target['measured']})")
    return md


def make_jobs(work: Workload, vocab_size: int, seed: int) -> list[Job]:
    """``work.requests`` requests of random token ids, lengths uniform in the ranges."""
    rng = random.Random(seed)
    return [Job(_ids(rng, rng.randint(*work.prompt), vocab_size), rng.randint(*work.output))
            for _ in range(work.requests)]


def prefix_jobs(work: Workload, vocab_size: int, seed: int) -> tuple[Job, list[Job]]:
    """``(warm-up, requests)``: each the same ``work.system`` tokens + its own user part;
    the warm-up asks for one token (it fills the prefix cache)."""
    rng = random.Random(seed + 1)
    system = _ids(rng, work.system, vocab_size)
    warmup = Job(system + _ids(rng, rng.randint(*work.user), vocab_size), 1)
    return warmup, [Job(system + _ids(rng, rng.randint(*work.user), vocab_size),
                        work.prefix_output) for _ in range(work.prefix_requests)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between the
    closest ranks (numpy's default): sorted ``x``, rank ``r = q / 100 * (n - 1)``, value
    ``x[floor r] + (r - floor r) * (x[floor r + 1] - x[floor r])``. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected a percentile in [0, 100], got {q!r}")
    if not values:
        return None
    x = sorted(values)
    rank = q / 100 * (len(x) - 1)
    low = int(rank)
    if low + 1 >= len(x):
        return float(x[-1])
    return float(x[low] + (rank - low) * (x[low + 1] - x[low]))


def summarize(outcomes: Sequence[Outcome], wall: float) -> dict:
    """A run's figures: requests done / cut / failed, output tokens, ``wall`` seconds,
    tokens/s, TTFT and ITL p50/p95 in milliseconds (None where nothing was measured)."""
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    gaps = [g for o in outcomes for g in o.gaps]
    tokens = sum(o.tokens for o in outcomes)
    ms = {f"{name}_p{q}_ms": None if (v := percentile(values, q)) is None else 1e3 * v
          for name, values in (("ttft", ttfts), ("itl", gaps)) for q in (50, 95)}
    errors = [o.error for o in outcomes if o.error not in (None, "cut")]
    return {"done": sum(o.error is None for o in outcomes),
            "cut": sum(o.error == "cut" for o in outcomes), "failed": len(errors),
            "errors": sorted(set(errors))[:5], "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else None, **ms}


def drive(url: str, jobs: Sequence[Job], clients: int, time_limit: float, *,
          cut_after: int | None = None) -> tuple[list[Outcome], float]:
    """Send ``jobs`` to the server at ``url`` from ``clients`` threads, each taking the next
    job not taken, until all are done or ``time_limit`` seconds have passed. With
    ``cut_after``, each stream is closed (``"cut"``) once that many tokens have arrived.

    Returns the outcomes of the jobs started (in job order) and the wall time: from the
    start to the end of the last one.
    """
    check_positive("clients", clients)
    if not is_number(time_limit) or not 0 < time_limit <= MAX_SECONDS:
        raise ValueError(f"time_limit: expected seconds in (0, {MAX_SECONDS:g}], got "
                         f"{time_limit!r}")
    if cut_after is not None:
        check_positive("cut_after", cut_after)
    clients = min(clients, len(jobs))  # more threads than jobs would only wait
    start = time.perf_counter()
    deadline = start + time_limit
    todo, lock = iter(enumerate(jobs)), threading.Lock()
    outcomes: list[Outcome | None] = [None] * len(jobs)

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                taken = next(todo, None)
            if taken is None:
                return
            outcomes[taken[0]] = _send(url, taken[1], start, deadline, cut_after)

    threads = [threading.Thread(target=client, name=f"bench-client-{i}", daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline + GRACE_S - time.perf_counter()))
    if any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"time_limit: a client still runs {GRACE_S} s after the limit of "
                           f"{time_limit} s (a read that does not time out)")
    done = [o for o in outcomes if o is not None]
    return done, max((o.end for o in done), default=time.perf_counter() - start)


@contextmanager
def serving(folder: str | Path, **options: object) -> Iterator[tuple[str, ServerState]]:
    """``attnlab serve``'s app for ``folder`` (``options``: ``create_app``'s) under uvicorn
    on 127.0.0.1 on a free port, in a thread, until the block ends; yields its URL and the
    app's ``ServerState`` (``state.engine.stats``: the engine's counters)."""
    app = create_app(folder, served_name=SERVED_NAME, **options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="bench-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not server.started:
            raise RuntimeError(f"the server on 127.0.0.1:{sock.getsockname()[1]} did not "
                               f"start within {START_TIMEOUT_S} s")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.serving
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()


def write_tokenizer(folder: str | Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` into ``folder``: a word-level ``tokenizers`` file whose
    ``vocab_size`` tokens are ``w0 .. w{V-1}`` (split on whitespace, decoded joined by
    spaces). Every id a model of that vocabulary generates decodes to text of its own: a
    tokenizer trained on a few lines would cover a few hundred ids of Qwen2's 151,936."""
    check_positive("vocab_size", vocab_size)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)},
                                         unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(Path(folder) / "tokenizer.json"))


def _send(url: str, job: Job, start: float, deadline: float, cut_after: int | None
          ) -> Outcome:
    """One streamed completion request; closes the stream once ``deadline`` passes or
    ``cut_after`` tokens (None: no such cut) have arrived."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": SERVED_NAME, "prompt": list(job.prompt),
                       "max_tokens": job.max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    arrivals: list[float] = []
    usage: int | None = None
    error: str | None = None
    sent = time.perf_counter()
    connection = http.client.HTTPConnection(host, int(port), timeout=_left(deadline))
    try:
        connection.connect()
        sock = connection.sock  # kept: http.client may drop its own reference mid-response
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status != 200:
            error = f"HTTP {reply.status}: {reply.read(200).decode('utf-8', 'replace')}"
        while error is None:
            sock.settimeout(_left(deadline))
            line = reply.readline(MAX_LINE_BYTES)
            now = time.perf_counter()
            if now >= deadline:
                error = "cut"
            elif not line:
                error = "the stream ended without data: [DONE]"
            elif line.startswith(b"data: "):
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    break
                text, count, error = _event(data)
                usage = usage if count is None else count
                if text:
                    arrivals.append(now)
                    if len(arrivals) == cut_after:
                        error = "cut"
    except TimeoutError:
        error = "cut"
    except (OSError, http.client.HTTPException, ValueError) as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        connection.close()
    end = time.perf_counter()
    return Outcome(ttft=arrivals[0] - sent if arrivals else None,
                   gaps=tuple(b - a for a, b in pairwise(arrivals)),
                   tokens=len(arrivals) if usage is None else usage, end=end - start,
                   error=error)


def _event(data: bytes) -> tuple[bool, int | None, str | None]:
    """One server-sent event's JSON: ``(whether it carries text, the usage chunk's
    completion_tokens or None, an error or None)``."""
    try:
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise TypeError(f"expected a JSON object, got {type(chunk).__name__}")
        if "error" in chunk:
            return False, None, f"server error: {str(chunk['error'])[:200]}"
        usage = chunk.get("usage") or {}
        count = usage.get("completion_tokens")
        if count is not None and (not is_int(count) or count < 0):
            raise TypeError(f"usage.completion_tokens: expected an int >= 0, got {count!r}")
        return any(c.get("text") for c in chunk.get("choices") or ()), count, None
    except (ValueError, TypeError, AttributeError) as failure:
        return False, None, f"a malformed event {data[:100]!r}: {failure}"


def _left(deadline: float) -> float:
    """Seconds to the deadline, at least a little (a socket timeout of 0 means non-blocking)."""
    return max(0.01, deadline - time.perf_counter())


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def _clients(text: str) -> tuple[int, ...]:
    values = int_list(text)
    if len(set(values)) != len(values) or max(values) > MAX_CLIENTS:
        raise argparse.ArgumentTypeError(f"expected each number of clients once, each at most "
                                         f"{MAX_CLIENTS}, got {text!r}")
    return values


_requests = number(int, lambda v: 1 <= v <= MAX_REQUESTS, f"an int in [1, {MAX_REQUESTS}]")


def _token_range(text: str) -> tuple[int, int]:
    """``argparse`` type for ``LO,HI``: two positive ints, LO <= HI."""
    values = int_list(text)
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return values[0], values[1]
_layers = number(int, lambda v: 1 <= v <= 24, "a number of layers in [1, 24] (Qwen2-0.5B's)")
_seconds = number(float, lambda v: 0 < v <= MAX_SECONDS,
                  f"a number of seconds in (0, {MAX_SECONDS:g}]")


def _check_options(engine: dict[str, int], work: Workload, context: int) -> None:
    """The options that the server would refuse, refused before the checkpoint is made."""
    if engine["max_tokens_per_step"] < engine["max_batch"]:
        raise ValueError(f"--max-tokens-per-step: expected at least --max-batch="
                         f"{engine['max_batch']} (one decode token per running request), "
                         f"got {engine['max_tokens_per_step']}")
    if engine["page_size"] > context:
        raise ValueError(f"--page-size: expected at most the model's context of {context} "
                         f"tokens, got {engine['page_size']}")
    if work.prompt[1] + work.output[1] > context:
        raise ValueError(f"--prompt-tokens, --output-tokens: the longest prompt "
                         f"({work.prompt[1]}) and output ({work.output[1]}) exceed the "
                         f"model's context of {context} tokens")
    if work.system + work.user[1] + work.prefix_output > context:
        raise ValueError(f"--system-tokens: a prompt of {work.system} + {work.user[1]} tokens "
                         f"and {work.prefix_output} new ones exceed the model's context of "
                         f"{context} tokens; expected at most "
                         f"{context - work.user[1] - work.prefix_output}")
