"""Request bodies that a client can get wrong or send to hurt, on a live server over raw
sockets: a chunked body over the limit is a 413, a body shorter than its Content-Length a 408
(the connection is not held forever, and ``/health`` answers meanwhile), deeply nested JSON and
invalid UTF-8 a 400 saying so, a chat message without content a 400 naming it, and a body
being checked (seconds for 8 MiB of small items) does not hold the others."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from server_live import HANG_S, live, raw

from attnlab.serving import api
from attnlab.serving.server import create_app

LIMIT = 2**18  # the servers' max_body_bytes: a 200 kB nested body fits
HOLD_S = 120.0  # a hang guard on a check held until /health answers (in milliseconds)
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(qwen2_folder):
    """A server whose body timeout is short: the tests that wait for it take that long."""
    app = create_app(qwen2_folder, kv_pages=64, page_size=8, max_body_bytes=LIMIT,
                     body_timeout_s=1.0)
    with live(app) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HANG_S)


def answer(sock: socket.socket) -> tuple[int, dict, str]:
    """Everything until the server closes the connection: (status, headers, body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body.decode()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_a_chunked_body_over_the_limit_is_413(server) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                     + chunked(*[b" " * 2**16] * (LIMIT // 2**16 + 1)))
        status, headers, body = answer(sock)  # and the connection is closed
    assert status == 413 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "body_too_large" and f"at most {LIMIT} bytes" in error["message"]


def test_a_chunked_body_under_the_limit_is_served(server, qwen2_folder) -> None:
    text = json.dumps({"model": qwen2_folder.name, "prompt": "the fox", "max_tokens": 2,
                       "temperature": 0}).encode()
    with connect(server) as sock:
        sock.sendall(HEAD + b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunked(text[:10], text[10:]))
        status, _, body = answer(sock)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_a_body_shorter_than_its_length_times_out_as_408(server) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"model\":")
        status, headers, body = answer(sock)  # the server's 1 s, not the client's guard
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "body_timeout" and "after 9 bytes" in error["message"]


def test_health_answers_while_a_body_never_ends(qwen2_folder) -> None:
    app = create_app(qwen2_folder, kv_pages=64, page_size=8, body_timeout_s=HANG_S)
    with live(app) as url, connect(url) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"model\":")
        assert raw(url, "GET", "/health")[0] == 200
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer yet: the body is still awaited
            sock.recv(1)


@pytest.mark.parametrize(("body", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "body: JSON nested too deeply"),
    (b"[" * 100_000, "body: JSON nested too deeply"),
    (b'{"model": "m", "prompt": "a", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "body: JSON nested too deeply"),
    (b'{"model": "m", "prompt": "caf\xe9"}', "body: not valid UTF-8: byte 0xe9 at offset 29"),
    (b'\xff{"model": "m"}', "body: not valid UTF-8: byte 0xff at offset 0"),
    (b'{"model": "m", "prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
     "body: not valid JSON here: Exceeds the limit (4300 digits)"),
    (b"", "body: expected a JSON object, got an empty body"),
], ids=["nested", "nested-unclosed", "nested-field", "latin-1", "bad-start", "long-integer",
        "empty"])
def test_unparsable_bodies_are_400_saying_why(server, body: bytes, message: str) -> None:
    status, _, text = raw(server, "POST", "/v1/completions", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(message), \
        error


@pytest.mark.parametrize("message", [
    {"role": "user"}, {"role": "system"}, {"role": "assistant"}, {"role": "developer"},
    {"role": "tool"}, {"role": "user", "content": None}, {"role": "assistant", "content": None},
])
def test_a_chat_message_without_content_is_400(server, qwen2_folder, message) -> None:
    body = {"model": qwen2_folder.name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}, message]}
    status, _, text = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "messages.1.content", error
    assert error["message"].startswith("messages.1.content: ")


@pytest.mark.parametrize("where", ["json.loads", "validator"])
def test_health_answers_while_a_body_is_being_parsed_and_checked(server, qwen2_folder,
                                                                 monkeypatch, where) -> None:
    """The parse of a body (``json.loads``) and its check (pydantic, with our validators) run
    off the event loop: here either waits, for this request's body only, until ``/health``
    has answered (on the loop, each held every other request for as long as it took: seconds
    for 8 MiB of small items)."""
    checking, answered, waited = threading.Event(), threading.Event(), []
    owner, name = (json, "loads") if where == "json.loads" else (api, "_is_unicode")
    real = getattr(owner, name)

    def held(text, *args, **kwargs):
        if "held fox" in (text if isinstance(text, str) else text.decode("latin-1")):
            checking.set()
            # True when /health answered while this waited (on the loop, it cannot).
            waited.append(answered.wait(HOLD_S))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    replies = []
    body = {"model": qwen2_folder.name, "prompt": "the held fox", "max_tokens": 1}
    client = threading.Thread(target=lambda: replies.append(raw(server, "POST",
                                                                "/v1/completions", body)))
    client.start()
    try:
        assert checking.wait(HANG_S), f"{where} never saw the body"
        status, _, text = raw(server, "GET", "/health")
        answered.set()
        assert (status, text) == (200, '{"status":"ok"}')
    finally:
        answered.set()
        client.join(HANG_S)
    assert waited == [True], f"/health answered only after {where} ended"
    assert replies and replies[0][0] == 200, replies


def test_connections_past_the_limit_are_503_and_served_again_once_closed(qwen2_folder) -> None:
    """``--max-connections`` (uvicorn's ``limit_concurrency``): idle connections that a client
    opens and never uses cannot take every file descriptor; past the limit a request is a 503,
    and once they close the server answers again."""
    app = create_app(qwen2_folder, kv_pages=64, page_size=8)
    with live(app, limit_concurrency=3) as url:
        idle = [connect(url) for _ in range(3)]
        try:
            with connect(url) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status, _, _ = answer(sock)
            assert status == 503
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + HANG_S  # the server notices the closes as events come
        while True:
            with connect(url) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status, _, _ = answer(sock)
            if status == 200 or time.monotonic() > deadline:
                break
        assert status == 200


def test_serve_passes_max_connections_to_uvicorn(qwen2_folder, monkeypatch) -> None:
    from attnlab.cli import build_parser
    from attnlab.cli import serve as cli_serve

    seen = {}

    class Stop(cli_serve.ReadyServer):
        def run(self, *args, **kwargs) -> None:
            seen["limit"] = self.config.limit_concurrency

    monkeypatch.setattr(cli_serve, "ReadyServer", Stop)
    for extra, limit in (([], cli_serve.DEFAULT_MAX_CONNECTIONS),
                         (["--max-connections", "7"], 7)):
        args = build_parser().parse_args(["serve", "--model", str(qwen2_folder), *extra])
        cli_serve.run_serve(args)
        assert seen["limit"] == limit
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", str(qwen2_folder),
                                   "--max-connections", "0"])
