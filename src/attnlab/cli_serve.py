"""``attnlab serve``: an OpenAI-compatible HTTP server for a checkpoint folder.

    attnlab serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-batch 8]
                  [--max-tokens-per-step 512] [--kv-pages N] [--page-size 16]
                  [--max-tokens-limit N] [--max-n N]
                  [--dtype DTYPE] [--quantize int8|int4] [--extra-memory]

The app is ``attnlab.serving.server.create_app``, run by uvicorn; the URL is printed once the
socket listens (``--port 0`` takes a free port and prints it).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys

import uvicorn

from attnlab.arg_types import number, positive_int
from attnlab.models.hf_loading import SUPPORTED_DTYPES
from attnlab.quantization import METHODS
from attnlab.serving.api import MAX_N
from attnlab.serving.server import create_app
from attnlab.threads import add_threads_option

__all__ = ["ReadyServer", "add_commands", "run_serve"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the top-level sub-parsers."""
    p = sub.add_parser("serve", help="serve a checkpoint folder over an OpenAI-compatible "
                       "HTTP API (continuous batching, paged KV cache)",
                       description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (as `attnlab generate "
                   "--model`), with its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every "
                   "interface; the server has no authentication)")
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
    p.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default=None,
                   help="weights and activations dtype (default: the checkpoint's)")
    p.add_argument("--quantize", choices=sorted(METHODS), default=None,
                   help="quantize the weights on loading (default: as stored)")
    p.add_argument("--extra-memory", action="store_true",
                   help="keep oneDNN's packed copies beside the weights where calibration finds "
                   "them faster (batched decoding: up to twice the weights' memory)")
    add_threads_option(p)
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the folder, then serve until interrupted (Ctrl-C)."""
    app = create_app(args.model, quantize=args.quantize, dtype=args.dtype,
                     extra_memory=args.extra_memory, max_batch=args.max_batch,
                     max_tokens_per_step=args.max_tokens_per_step, kv_pages=args.kv_pages,
                     page_size=args.page_size, max_queue=args.max_queue,
                     max_tokens_limit=args.max_tokens_limit, max_n=args.max_n)
    server = ReadyServer(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level="warning"))
    # uvicorn re-raises Ctrl-C once it has shut down: the usual way to stop.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if server.url is None:
        return 1
    print("attnlab serve: stopped", file=sys.stderr)
    return 0


_port = number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535] (0: a free one)")
_max_n = number(int, lambda v: 1 <= v <= MAX_N, f"an int in [1, {MAX_N}]")


class ReadyServer(uvicorn.Server):
    """A uvicorn server that prints its URL once it listens, and keeps it in ``url``."""

    url: str | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            print(f"attnlab serve: {self.url}/v1 (serving {self.config.app.state.serving.name}"
                  "; Ctrl-C stops)", flush=True)
        else:
            print("attnlab serve: the server did not start", file=sys.stderr, flush=True)
