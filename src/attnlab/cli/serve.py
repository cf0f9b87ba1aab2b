"""``attnlab serve``: an OpenAI-compatible HTTP server for a checkpoint folder.

    attnlab serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-batch 8]
                  [--max-tokens-per-step 512] [--kv-pages N] [--page-size 16]
                  [--max-tokens-limit N] [--max-n N]
                  [--dtype DTYPE] [--quantize int8|int4] [--extra-memory]
                  [--max-connections 256] [--shutdown-grace SECONDS]
                  [--api-key KEY] [--allowed-origin ORIGIN]
                  [--speculative ngram|ngram:K|self:N|draft:FOLDER]

The app is ``attnlab.serving.server.create_app``, run by uvicorn; the URL is printed once the
socket listens (``--port 0`` takes a free port and prints it).

Stopping (Ctrl-C or SIGTERM): new requests are answered 503 at once; the running ones have
``--shutdown-grace`` seconds to finish; those still running then end (a stream with a last
chunk per choice, ``finish_reason: "abort"``, an error object and ``[DONE]``; a plain answer
with a 503), their KV cache pages are freed and the command exits 0. A second Ctrl-C (or
SIGTERM) ends them at once and exits 130 (143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn

from attnlab.arg_types import non_negative_float, number, positive_int
from attnlab.cli import add_command
from attnlab.cli.options import add_dtype_option, add_model_option
from attnlab.quantization import METHODS
from attnlab.serving.api import MAX_N
from attnlab.serving.server import create_app
from attnlab.serving.speculation import speculation_from, split_draft
from attnlab.threads import add_threads_option

__all__ = ["DEFAULT_SHUTDOWN_GRACE_S", "ReadyServer", "add_commands", "run_serve"]

DEFAULT_SHUTDOWN_GRACE_S = 5.0
# The key from the environment: a --api-key on the command line is visible to every user of
# the machine (ps), a variable is not.
API_KEY_VARIABLE = "ATTNLAB_API_KEY"
# Well under a common open-file limit of 1024, far over what one CPU's engine serves at once.
DEFAULT_MAX_CONNECTIONS = 256
# A hang guard for the requests ended at the stop to write their last chunk, and for uvicorn's
# own wait on the connections after that: they have nothing left to compute.
CUT_GUARD_S = 10.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the top-level sub-parsers."""
    p = add_command(sub, "serve", __doc__)
    add_model_option(p, "checkpoint folder (as `attnlab generate --model`), with its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every "
                   "interface; without --api-key, anyone who reaches it may call it)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="answer 401 on every route but /health without the header "
                   "'Authorization: Bearer KEY' (default: $ATTNLAB_API_KEY, else no key)")
    p.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browser pages of ORIGIN (https://host[:port], or *) call the API "
                   "(CORS); repeat for several (default: none, CORS off)")
    p.add_argument("--port", type=_port, default=8000, help="port (0: a free one)")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="requests decoded together at most")
    p.add_argument("--max-tokens-per-step", type=positive_int, default=512, metavar="N",
                   help="tokens (prefill chunks + decodes) per engine step at most")
    p.add_argument("--kv-pages", type=positive_int, default=None, metavar="N",
                   help="KV cache pages (default: the engine's)")
    p.add_argument("--page-size", type=positive_int, default=16, metavar="N",
                   help="tokens per KV cache page")
    p.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                   help="requests waiting at most; more are answered 429")
    p.add_argument("--max-tokens-limit", type=positive_int, default=None, metavar="N",
                   help="new tokens a choice may ask for at most; more are answered 400, and "
                   "a request that does not say gets at most this many (default: what fits "
                   "the context and the KV cache)")
    p.add_argument("--max-n", type=_max_n, default=MAX_N, metavar="N",
                   help=f"choices (n) a request may ask for at most, in [1, {MAX_N}]; more "
                   "are answered 400")
    add_dtype_option(p, "weights and activations dtype (default: the checkpoint's)")
    p.add_argument("--quantize", choices=sorted(METHODS), default=None,
                   help="quantize the weights on loading (default: as stored)")
    p.add_argument("--extra-memory", action="store_true",
                   help="keep oneDNN's packed copies beside the weights where calibration finds "
                   "them faster (batched decoding: up to twice the weights' memory)")
    p.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS,
                   metavar="N", help="open connections at most (each holds a file descriptor: "
                   "a flood of idle ones must not use up the process's); past it new requests "
                   "are answered 503")
    p.add_argument("--shutdown-grace", type=non_negative_float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   metavar="SECONDS", help="on Ctrl-C or SIGTERM, how long the running requests "
                   "may go on before they are ended (new ones are refused at once)")
    p.add_argument("--speculative", type=_speculative, default=None,
                   metavar="ngram[:K]|self:N|draft:FOLDER",
                   help="speculative decoding for requests that do not choose (a request's "
                   "speculative field does): same text, fewer passes over the weights while "
                   "few requests decode together (default: off); draft:FOLDER loads a draft "
                   "model sharing the tokenizer, which requests may then ask for (draft)")
    add_threads_option(p)
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the folder, then serve until interrupted (Ctrl-C or SIGTERM); 0 after a stop that
    let the requests finish or ended them after the grace, 128 + the signal after a second
    signal."""
    app = create_app(args.model, quantize=args.quantize, dtype=args.dtype,
                     extra_memory=args.extra_memory, max_batch=args.max_batch,
                     max_tokens_per_step=args.max_tokens_per_step, kv_pages=args.kv_pages,
                     page_size=args.page_size, max_queue=args.max_queue,
                     max_tokens_limit=args.max_tokens_limit, max_n=args.max_n,
                     api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                     allowed_origins=args.allowed_origin or (),
                     speculative=args.speculative)
    server = ReadyServer(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level="warning",
                                        limit_concurrency=args.max_connections),
                         shutdown_grace=args.shutdown_grace)
    server.run()
    if server.url is None:
        return 1
    print("attnlab serve: stopped", file=sys.stderr)
    return server.exit_status


def _speculative(text: str) -> str:
    """``--speculative``: checked as a request's ``speculative`` is (``draft:FOLDER``: the
    folder is read when the server starts)."""
    try:
        if split_draft(text) is None:
            speculation_from(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("speculative: ")) from None
    return text


_port = number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535] (0: a free one)")
_max_n = number(int, lambda v: 1 <= v <= MAX_N, f"an int in [1, {MAX_N}]")


class ReadyServer(uvicorn.Server):
    """A uvicorn server that prints its URL once it listens, and keeps it in ``url``, and that
    stops in bounds: on SIGINT or SIGTERM (or ``stop()`` on its loop) it refuses new requests,
    gives the running ones ``shutdown_grace`` seconds, then ends them (see
    ``attnlab.serving.shutdown``); a second signal ends them at once and sets ``exit_status``
    to 128 + that signal."""

    url: str | None = None

    def __init__(self, config: uvicorn.Config,
                 shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        if config.timeout_graceful_shutdown is None:  # uvicorn's default: wait forever
            config.timeout_graceful_shutdown = CUT_GUARD_S
        super().__init__(config)
        self.shutdown_grace = shutdown_grace
        self.exit_status = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._now: asyncio.Event | None = None  # set by a second signal
        self._stopping: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            print(f"attnlab serve: {self.url}/v1 (serving {self.config.app.state.serving.name}"
                  "; Ctrl-C stops)", flush=True)
        else:
            print("attnlab serve: the server did not start", file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (uvicorn installs it for SIGINT and SIGTERM). Unlike uvicorn's,
        it does not raise the signal again once the server is down: the exit status says how
        it stopped, without a traceback."""
        if self._loop is None or not self.started:  # still starting: stop when started
            self.should_exit = True
            return
        # A signal handler runs between two bytecodes of the loop's thread: the work goes
        # to the loop.
        self._loop.call_soon_threadsafe(self.stop, sig)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Begin the bounded stop (on the server's loop); a second call ends the requests
        still running at once, and the exit status becomes 128 + ``sig``."""
        if self._stopping is None:
            self._now = asyncio.Event()
            self._stopping = asyncio.ensure_future(self._stop())
        elif not self._now.is_set():
            self.exit_status = 128 + sig
            self._now.set()

    async def _stop(self) -> None:
        drain = self.config.app.state.serving.drain
        drain.stop_admitting()
        running = drain.running
        if running:
            print(f"attnlab serve: stopping; finishing {_requests(running)} (at most "
                  f"{self.shutdown_grace:g} s), Ctrl-C again to stop now", file=sys.stderr,
                  flush=True)
        if not await drain.idle(self.shutdown_grace, until=self._now):
            ended = drain.cut("the server is stopping")
            why = "at once" if self._now.is_set() else \
                f"after the {self.shutdown_grace:g} s grace"
            print(f"attnlab serve: ended {_requests(ended)} {why}", file=sys.stderr, flush=True)
            await drain.idle(CUT_GUARD_S)
        # Not uvicorn's force_exit: it skips the app's shutdown, whose task is then cancelled
        # with a traceback; nothing is left to wait for, and the engine frees the pages.
        self.should_exit = True


def _requests(n: int) -> str:
    return f"{n} request{'s' * (n != 1)}"
