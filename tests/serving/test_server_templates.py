"""``attnlab serve`` keeps serving while a chat template or a large prompt is being worked on,
on a live server: every failure of the model's chat template (an exception, its memory or
time limit) is a 400 naming the template's file, ``/health`` answers while a hostile template
renders and while a prompt is tokenized (events, not times), and the server goes on."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
from server_live import live, raw

from attnlab import chat_render
from attnlab.chat_render import TemplateRenderer
from attnlab.serving.server import create_app

HANG_S = 600.0  # a hang guard: far above any wait here on a busy 2-core machine
HEALTH_S = 60.0  # /health's hang guard: it answers at once unless the event loop is held
HOLD_S = 120.0  # a hang guard on renders held until a completion is answered (milliseconds)
# A template whose behaviour the last message chooses; "hello" renders a normal prompt.
TEMPLATE = """\
{%- macro f(n) %}{{ f(n) }}{% endmacro -%}
{%- set m = messages[-1]['content'] -%}
{%- if m == 'loop' -%}
{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}
{%- elif m == 'flood' -%}{{ 'a' * 10**10 }}
{%- elif m == 'divide' -%}{{ 1 / 0 }}
{%- elif m == 'include' -%}{% include 'other.jinja' %}
{%- elif m == 'import' -%}{% import 'other.jinja' as other %}
{%- elif m == 'recurse' -%}{{ f(1) }}
{%- elif m == 'type' -%}{{ m + 1 }}
{%- else -%}<|im_start|>user
{{ m }}<|im_end|>
<|im_start|>assistant
{% endif -%}
"""


@pytest.fixture(scope="module")
def folder(qwen2_folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile-template") / "model"
    shutil.copytree(qwen2_folder, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(folder):
    app = create_app(folder, max_batch=2, page_size=4, kv_pages=256)
    with live(app) as url:
        yield app, url


@pytest.fixture
def renderer(server, monkeypatch: pytest.MonkeyPatch):
    """The server's tokenizer renders with a renderer of this test (its limits the test's)."""
    renderer = TemplateRenderer(timeout_s=HANG_S)
    monkeypatch.setattr(server[0].state.serving.tokenizer, "renderer", renderer)
    yield renderer
    renderer.close()


def chat(server, content: str) -> tuple[int, dict]:
    body = {"model": "model", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    status, _, text = raw(server[1], "POST", "/v1/chat/completions", body)
    return status, json.loads(text)


def healthy(server) -> bool:
    status, _, _ = raw(server[1], "GET", "/health", timeout=HEALTH_S)
    return status == 200


@pytest.mark.parametrize(("content", "error"), [
    ("divide", "ZeroDivisionError"),
    ("include", "TypeError"),
    ("import", "TypeError"),
    ("recurse", "RecursionError"),
    ("type", "TypeError"),
    ("flood", "MemoryError"),  # 10 GB asked: refused by the worker's 1 GiB, nothing allocated
])
def test_a_failing_template_is_a_400_naming_its_file(server, folder, content, error) -> None:
    status, body = chat(server, content)
    assert status == 400, body
    message = body["error"]["message"]
    assert message.startswith(f"messages: {folder / 'chat_template.jinja'}: the chat template "
                              f"cannot render the messages ({error}, template line ")
    assert body["error"]["param"] == "messages"
    assert chat(server, "hello")[0] == 200


def test_a_template_past_its_time_limit_is_a_400_and_the_server_goes_on(server, folder,
                                                                       renderer) -> None:
    renderer.timeout_s = 0.5
    status, body = chat(server, "loop")
    assert status == 400, body
    assert body["error"]["message"] == (
        f"messages: {folder / 'chat_template.jinja'}: the chat template did not finish within "
        "0.5 s (the render's time limit); it was stopped")
    renderer.timeout_s = HANG_S
    assert chat(server, "hello")[0] == 200


def test_health_answers_while_a_hostile_template_renders(server, folder, renderer,
                                                         monkeypatch) -> None:
    """The hostile request is still rendering (its worker loops) when /health answers; then
    its worker is killed (as the time limit would), which is a 400 for that request only."""
    workers, sent = [], threading.Event()
    real = chat_render._Worker.exchange

    def exchange(self, request, deadline):
        if request:
            workers.append(self)
            sent.set()
        return real(self, request, deadline)

    monkeypatch.setattr(chat_render._Worker, "exchange", exchange)
    answers: list[tuple[int, dict]] = []
    request = threading.Thread(target=lambda: answers.append(chat(server, "loop")))
    request.start()
    try:
        assert sent.wait(HANG_S), "the hostile render never reached its worker"
        assert healthy(server)
        assert request.is_alive() and workers[0].process.poll() is None  # still rendering
    finally:
        workers[0].process.kill()
        request.join(HANG_S)
    status, body = answers[0]
    assert status == 400 and body["error"]["message"].startswith(
        f"messages: {folder / 'chat_template.jinja'}: the chat template's render process "
        "ended")
    assert chat(server, "hello")[0] == 200


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_health_answers_while_a_prompt_is_tokenized(server, monkeypatch, route) -> None:
    """A prompt whose tokenizing does not end until the test says so (a 7 MB prompt takes
    seconds): /health answers meanwhile, then the request completes."""
    tokenizer = server[0].state.serving.tokenizer
    started, release = threading.Event(), threading.Event()
    real = tokenizer.encode

    def blocking(text: str, *args, **kwargs) -> list[int]:
        if "large prompt" in text:
            started.set()
            release.wait(HANG_S)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", blocking)
    if route == "chat":
        path, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a large prompt"}]}
    else:
        path, body = "/v1/completions", {"prompt": "a large prompt"}
    body = {"model": "model", "max_tokens": 2, **body}
    answers: list[int] = []
    request = threading.Thread(
        target=lambda: answers.append(raw(server[1], "POST", path, body)[0]))
    request.start()
    try:
        assert started.wait(HANG_S), "the prompt was never tokenized"
        assert healthy(server)
        assert request.is_alive()
    finally:
        release.set()
        request.join(HANG_S)
    assert answers == [200]


def test_a_slow_template_does_not_hold_the_other_requests_tokenizing(server,
                                                                       monkeypatch) -> None:
    """More chat requests than asyncio's default threads, each rendering until the test says
    so (a slow template takes up to its time limit, 10 s, each): a completion's prompt is
    still tokenized and answered meanwhile (it waited for a thread behind them: 20 s here)."""
    tokenizer = server[0].state.serving.tokenizer
    rendering, release, released = threading.Semaphore(0), threading.Event(), []
    real = tokenizer.apply_chat_template

    def slow(*args, **kwargs):
        rendering.release()
        # True when the completion was answered while this rendered.
        released.append(release.wait(HOLD_S))
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow)
    chats = min(32, (os.cpu_count() or 1) + 4) + 1  # ThreadPoolExecutor's default, and one
    answers: list[int] = []
    requests = [threading.Thread(target=lambda: answers.append(chat(server, "hello")[0]))
                for _ in range(chats)]
    for request in requests:
        request.start()
    try:
        assert rendering.acquire(timeout=HANG_S), "no chat request reached its template"
        status, _, _ = raw(server[1], "POST", "/v1/completions",
                           {"model": "model", "prompt": "the fox", "max_tokens": 1})
        release.set()
        assert status == 200
    finally:
        release.set()
        for request in requests:
            request.join(HANG_S)
    assert released and all(released), "the completion was answered only after the renders"
    assert answers == [200] * chats
