"""``attnlab serve`` under bad input and overload, on a live server: OpenAI's error JSON with
400 naming the field (context overflow, malformed JSON, wrong types, out-of-range values),
404 for another model, 413 for a huge body, 429 when the queue is full, 500 when the engine or
a handler fails (the server goes on), and a client leaving mid-stream aborts its request and
frees its KV cache pages."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import openai
import pytest
from server_live import client, live, raw, server_fixtures, wait_for

from attnlab.models.io import from_pretrained
from attnlab.serving import engine as engine_module
from attnlab.serving.server import create_app
from attnlab.tokenizer import Tokenizer
from conftest import pause_until_abort

PROMPT = "once upon a time"
CONTEXT = 256  # make_folder's max_position_embeddings
HANG_S = 600  # a hang guard: far above any wait here on a busy 2-core machine
PAUSE_AT = 20  # tokens after which a watched engine waits for an abort


server, api, tok = server_fixtures(max_batch=2, page_size=4, kv_pages=256)


def post(server, path: str, body) -> tuple[int, dict]:
    status, _, text = raw(server[1], "POST", path, body)
    return status, json.loads(text)


def idle(app) -> bool:
    stats = app.state.serving.engine.stats
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == 0


def completion(qwen2_folder, **fields) -> dict:
    return {"model": qwen2_folder.name, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(qwen2_folder, **fields) -> dict:
    return {"model": qwen2_folder.name, "messages": [{"role": "user", "content": "hi"}], **fields}


BAD_COMPLETIONS = [
    ({"max_tokens": CONTEXT}, "max_tokens", "maximum context length is 256"),
    ({"prompt": "fox " * 300}, "prompt", "leaving no room"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"max_tokens": 2.5}, "max_tokens", "valid integer"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo: true"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -1}, "top_k", "greater than or equal to 0"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 1000}, "n", "less than or equal to 16"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": 2**70}, "seed", "less than or equal to"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ""}, "stop", "at least 1 character"),
    ({"stop": 3}, "stop", "valid list"),
    ({"stop": ["a", 3]}, "stop", "valid string"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": ""}, "prompt", "expected a non-empty text"),
    ({"prompt": []}, "prompt", "expected a non-empty text"),
    ({"prompt": [[1], []]}, "prompt", "expected a non-empty text"),
    ({"prompt": [1, "a"]}, "prompt", "expected a non-empty text"),
    ({"prompt": [True]}, "prompt", "expected a non-empty text"),
    ({"prompt": [1, 10**6]}, "prompt", "out of range"),
    ({"prompt": [-1]}, "prompt", ""),
    ({"prompt": None}, "prompt", ""),
    ({"model": 3}, "model", "valid string"),
    ({"prompt": "\ud800"}, "prompt", "valid Unicode"),
    ({"prompt": ["ok", "a\udfff"]}, "prompt", "valid Unicode"),
    ({"logprobs": 6}, "logprobs", "expected an int in [0, 5]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only with stream: true"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
     "valid boolean"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD_COMPLETIONS,
                         ids=[str(f)[:40] for f, _, _ in BAD_COMPLETIONS])
def test_bad_completion_is_400_naming_the_field(server, qwen2_folder, fields, param,
                                                message) -> None:
    status, body = post(server, "/v1/completions", completion(qwen2_folder, **fields))
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].split(".")[0] == param
    assert error["message"].startswith(param)
    assert message in error["message"]


BAD_CHATS = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'system'"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", "'text'"),
    ({"messages": [{"role": "user", "content": "\udc00"}]}, "messages.0.content",
     "valid Unicode"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages.0.content.0.text", "valid Unicode"),
    ({"max_tokens": CONTEXT}, "max_tokens", "maximum context length"),
    ({"max_completion_tokens": CONTEXT}, "max_completion_tokens", "maximum context length"),
    ({"messages": [{"role": "user", "content": "fox " * 300}]}, "messages", "no room"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD_CHATS,
                         ids=[str(f)[:40] for f, _, _ in BAD_CHATS])
def test_bad_chat_is_400_naming_the_field(server, qwen2_folder, fields, param, message) -> None:
    status, body = post(server, "/v1/chat/completions", chat(qwen2_folder, **fields))
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["message"].startswith(param)
    assert message in body["error"]["message"]


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"top_p": 1e-300},
                                    {"top_k": 10**9}, {"seed": 2**64 - 1, "n": 2}])
def test_extreme_sampling_values_are_served(server, qwen2_folder, fields) -> None:
    """A temperature under 1e-5 is greedy; a top_p under float32's range keeps the top
    token (greedy too); a top_k over the vocabulary keeps all; the largest seed wraps for
    the second choice."""
    status, body = post(server, "/v1/completions", completion(qwen2_folder, temperature=1.0,
                                                              max_tokens=6) | fields)
    assert status == 200, body
    if "seed" not in fields and "top_k" not in fields:
        _, greedy = post(server, "/v1/completions", completion(qwen2_folder, temperature=0,
                                                               max_tokens=6))
        assert body["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_the_openai_client_sees_the_400(server, qwen2_folder) -> None:
    api = client(server[1])
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=10_000)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "max_tokens"
    assert caught.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("body", "headers"), [
    (b"{not json", {}),
    (b'{"model": "m", "prompt": "x",', {}),
    (b"[1, 2]", {}),
    (b"\xff\xfe", {}),
    (b"", {}),
    (b'{"model": "m", "prompt": "x"}', {"Content-Type": "text/plain"}),
])
def test_malformed_body_is_400(server, body, headers) -> None:
    status, _, text = raw(server[1], "POST", "/v1/completions", body, headers)
    assert status == 400, text
    assert json.loads(text)["error"]["type"] == "invalid_request_error"


def test_unknown_model_route_and_method(server, qwen2_folder) -> None:
    status, body = post(server, "/v1/completions", completion(qwen2_folder, model="gpt-4"))
    assert status == 404 and body["error"]["param"] == "model"
    assert body["error"]["code"] == "model_not_found"
    status, _, text = raw(server[1], "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(text)
    status, _, text = raw(server[1], "GET", "/v1/completions")
    assert status == 405 and "error" in json.loads(text)


def test_huge_body_is_refused_before_it_is_read(qwen2_folder) -> None:
    app = create_app(qwen2_folder, max_body_bytes=1000)
    with live(app) as url:
        status, _, text = raw(url, "POST", "/v1/completions",
                              completion(qwen2_folder, prompt="fox " * 1000))
        assert status == 413 and json.loads(text)["error"]["code"] == "body_too_large"
        status, _, text = raw(url, "POST", "/v1/completions", completion(qwen2_folder))
        assert status == 200, text


def test_full_queue_is_429_and_the_server_goes_on(qwen2_folder) -> None:
    """One request decoding, one waiting (max_queue=1): of 6 at once, some are refused with
    429 and the others complete."""
    app = create_app(qwen2_folder, max_batch=1, max_queue=1, page_size=4, kv_pages=256)
    results: list[object] = []
    with live(app) as url:
        api = client(url)

        def ask() -> None:
            try:
                results.append(api.completions.create(model=qwen2_folder.name, prompt=PROMPT,
                                                      max_tokens=40, temperature=0))
            except openai.RateLimitError as error:
                results.append(error)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, openai.RateLimitError)]
        assert len(results) == 6 and refused and served
        assert all(e.status_code == 429 and e.body["code"] == "queue_full" for e in refused)
        assert len({r.choices[0].text for r in served}) == 1
        wait_for(lambda: idle(app), what="an idle engine")
        again = api.completions.create(model=qwen2_folder.name, prompt=PROMPT, max_tokens=40,
                                       temperature=0)
        assert again.choices[0].text == served[0].choices[0].text


def paused_and_watched(engine_thread, monkeypatch) -> list[str]:
    """The server's (idle) engine pausing once it has made ``PAUSE_AT`` tokens until the
    server asks to abort a request (``conftest.pause_until_abort``); the ids it asks to
    abort, as they come."""
    return pause_until_abort(engine_thread, monkeypatch, PAUSE_AT, HANG_S)[0]


def test_client_leaving_mid_stream_aborts_and_frees_pages(server, qwen2_folder,
                                                          monkeypatch) -> None:
    wait_for(lambda: idle(server[0]), what="an idle engine")
    aborted = paused_and_watched(server[0].state.serving.engine, monkeypatch)
    before = server[0].state.serving.engine.stats["tokens_generated"]
    host, port = server[1].removeprefix("http://").split(":")
    body = json.dumps(completion(qwen2_folder, max_tokens=200, stream=True, temperature=1.0,
                                 seed=1)).encode()
    with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        received = b""
        deadline = time.monotonic() + HANG_S
        while received.count(b"data: ") < 2 and time.monotonic() < deadline:
            received += sock.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
        assert server[0].state.serving.engine.stats["running"] == 1
    wait_for(lambda: idle(server[0]) and aborted, what="the request's pages to be freed")
    assert len(aborted) == 1  # aborted while running, not finished on its own
    assert server[0].state.serving.engine.stats["tokens_generated"] - before < 200


def test_client_leaving_a_non_streaming_request_aborts_it(server, qwen2_folder,
                                                          monkeypatch) -> None:
    wait_for(lambda: idle(server[0]), what="an idle engine")
    aborted = paused_and_watched(server[0].state.serving.engine, monkeypatch)
    host, port = server[1].removeprefix("http://").split(":")
    body = json.dumps(completion(qwen2_folder, max_tokens=200, n=2)).encode()
    with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        wait_for(lambda: server[0].state.serving.engine.stats["running"] == 2,
                 what="the request to run")
    wait_for(lambda: idle(server[0]) and len(aborted) == 2, what="both choices aborted")


def test_engine_failure_fails_the_request_and_the_engine_goes_on(server, qwen2_folder,
                                                                 monkeypatch) -> None:
    engine = server[0].state.serving.engine.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    status, body = post(server, "/v1/completions", completion(qwen2_folder, max_tokens=20))
    assert status == 500 and body["error"]["code"] == "engine_failure"
    assert "RuntimeError: boom" in body["error"]["message"]
    # Streaming: the error arrives as an event, then [DONE].
    calls.clear()
    status, _, text = raw(server[1], "POST", "/v1/completions",
                          completion(qwen2_folder, max_tokens=20, stream=True))
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_failure"
    status, body = post(server, "/v1/completions", completion(qwen2_folder, max_tokens=5))
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert raw(server[1], "GET", "/health")[0] == 200


def test_model_failure_in_the_engine_fails_its_requests_only(server, qwen2_folder,
                                                             monkeypatch) -> None:
    """The engine ends the requests of a step whose forward raised (an "abort" event with
    the error): the client gets a 500 naming it; the next request is served."""
    real, calls = engine_module.ModelRunner.hidden_states, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("model down")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module.ModelRunner, "hidden_states", failing)
    status, body = post(server, "/v1/completions", completion(qwen2_folder, max_tokens=5))
    assert status == 500 and "RuntimeError: model down" in body["error"]["message"]
    wait_for(lambda: idle(server[0]), what="the failed request's pages to be freed")
    status, body = post(server, "/v1/completions", completion(qwen2_folder, max_tokens=5))
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_handler_failure_is_500_json(server, qwen2_folder, monkeypatch) -> None:
    tokenizer = server[0].state.serving.tokenizer

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer down")

    monkeypatch.setattr(tokenizer, "encode", broken)
    status, _, text = raw(server[1], "POST", "/v1/completions", completion(qwen2_folder))
    assert status == 500 and json.loads(text)["error"]["type"] == "server_error"
    monkeypatch.undo()
    status, _, _ = raw(server[1], "POST", "/v1/completions", completion(qwen2_folder))
    assert status == 200


def test_create_app_refuses_bad_arguments_by_name(qwen2_folder) -> None:
    model, tok = from_pretrained(qwen2_folder), Tokenizer.from_pretrained(qwen2_folder)
    for kwargs, error, message in [
        ({"model": 3}, TypeError, "model: expected a folder"),
        ({"model": (tok, model)}, TypeError, "model: expected a folder or a (DecoderLM"),
        ({"model": (model, tok), "quantize": "int8"}, ValueError,
         "quantize, dtype, extra_memory: only for a folder"),
        ({"model": qwen2_folder, "max_body_bytes": 0}, ValueError, "max_body_bytes: expected a "
         "positive int, got 0"),
        ({"model": qwen2_folder, "served_name": ""}, TypeError, "served_name"),
        ({"model": qwen2_folder, "max_batch": 0}, ValueError, "max_batch"),
        ({"model": qwen2_folder / "missing"}, FileNotFoundError, "missing"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            create_app(**kwargs)
    app = create_app((model, tok), served_name="tiny")
    assert app.state.serving.name == "tiny"
