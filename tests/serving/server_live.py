"""A live ``attnlab serve`` app for the tests: uvicorn on 127.0.0.1 on a free port, in a
background thread, and an ``openai`` client for it."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import openai
import pytest
import uvicorn
from fastapi import FastAPI

from attnlab.cli.serve import ReadyServer
from attnlab.serving.server import create_app
from attnlab.tokenizer import Tokenizer

# Hang guards, far above the expected times on a busy 2-core machine.
START_TIMEOUT_S = STOP_TIMEOUT_S = HANG_S = 600.0


def server_fixtures(**config: object) -> tuple[Callable, Callable, Callable]:
    """Module-scoped fixtures ``(server, api, tok)`` for a test module to bind to those names:
    ``server`` is ``(app, url)`` of ``create_app(qwen2_folder, **config)`` served live while
    the module's tests run, ``api`` an ``openai`` client of it, ``tok`` the folder's
    tokenizer."""
    @pytest.fixture(scope="module")
    def server(qwen2_folder):
        app = create_app(qwen2_folder, **config)
        with live(app) as url:
            yield app, url

    @pytest.fixture(scope="module")
    def api(server):
        return client(server[1])

    @pytest.fixture(scope="module")
    def tok(qwen2_folder):
        return Tokenizer.from_pretrained(qwen2_folder)

    return server, api, tok


@contextmanager
def live(app: FastAPI, **config: object) -> Iterator[str]:
    """Serve ``app`` (with more ``uvicorn.Config`` options) until the block ends; yields its
    base URL (``http://127.0.0.1:PORT``)."""
    server = ReadyServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                        timeout_graceful_shutdown=5, **config))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.url is None and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if server.url is None:
        server.should_exit = True
        thread.join(10)
        raise RuntimeError("the test server did not start")
    try:
        yield server.url
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "the test server did not stop"


def client(url: str, timeout: float = HANG_S) -> openai.OpenAI:
    """The official client on ``url``, without retries (a 429 must reach the test)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)


def wait_for(condition, timeout: float = HANG_S, what: str = "a condition") -> None:
    """Poll ``condition()`` every 20 ms until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def raw(url: str, method: str, path: str, body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None, timeout: float = HANG_S
        ) -> tuple[int, dict, str]:
    """One plain HTTP request (``http.client``: any bytes, any headers); a dict body is sent
    as JSON. Returns ``(status, headers with lower-case names, body text)``."""
    if isinstance(body, dict):
        body = json.dumps(body)
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.request(method, path, body=body,
                           headers={"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        return (reply.status, {k.lower(): v for k, v in reply.getheaders()},
                reply.read().decode("utf-8"))
    finally:
        connection.close()
