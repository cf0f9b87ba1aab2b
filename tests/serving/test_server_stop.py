"""``attnlab serve`` stops in bounds: on SIGINT/SIGTERM it refuses new requests (503, and
``/health`` says "stopping"), lets the running ones finish within ``--shutdown-grace``, then
ends the rest with a last chunk (``finish_reason: "abort"``, an error object, ``[DONE]``; a
503 for a plain answer), frees their pages and exits 0; a second signal ends them at once and
exits 130, without a traceback. The signals are sent on events (a streamed token arrived, the
server said it is stopping), never after a sleep."""

from __future__ import annotations

import http.client
import json
import queue
import signal
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import openai
import pytest
import uvicorn
from server_live import HANG_S, client, raw, wait_for

from attnlab.cli.serve import ReadyServer
from attnlab.serving.server import create_app
from conftest import pause_until_abort

PROMPT = "once upon a time"
LONG_CONTEXT = 16384  # the long folder's context: a stream of 16,000 tokens outlasts any stop
PAUSE_AT = 5  # tokens after which a watched engine waits for an abort
# Greedy, so that no request ends early on an end token: the tiny model's greedy text from
# PROMPT (plain or as a chat) has none in its first 230 tokens, far more than a stop takes.


class Stream:
    """A streamed completion read line by line on its own thread: ``events`` holds each
    ``data:`` payload (parsed JSON, or the text ``[DONE]``) as it arrives, then None."""

    def __init__(self, url: str, body: dict, path: str = "/v1/completions") -> None:
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port,
                                                     timeout=HANG_S)
        self.connection.request("POST", path, body=json.dumps({**body, "stream": True}),
                                headers={"Content-Type": "application/json"})
        self.reply = self.connection.getresponse()
        assert self.reply.status == 200, self.reply.read()
        self.events: queue.Queue = queue.Queue()
        self.seen: list = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.reply:
                text = line.decode().strip()
                if text.startswith("data: "):
                    data = text.removeprefix("data: ")
                    self.events.put(data if data == "[DONE]" else json.loads(data))
        finally:
            self.events.put(None)
            self.connection.close()

    def next(self):
        event = self.events.get(timeout=HANG_S)
        self.seen.append(event)
        return event

    def first_token(self) -> None:
        """Wait for the first chunk with text."""
        while not (isinstance(event := self.next(), dict) and event["choices"]
                   and event["choices"][0].get("text")):
            assert event is not None, self.seen

    def rest(self) -> list:
        """Every payload until the connection closes."""
        while self.next() is not None:
            pass
        return self.seen[:-1]


def assert_cut(payloads: list) -> None:
    """The stream ended by the stop: a last chunk with finish_reason "abort", OpenAI's error
    object naming the stop, then [DONE], and nothing after."""
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = payloads[-2]["error"]
    assert error["code"] == "server_shutdown" and "stopping" in error["message"], error
    assert payloads[-3]["choices"][0]["finish_reason"] == "abort", payloads[-3]
    finishes = [c["finish_reason"] for p in payloads[:-3] for c in p["choices"]]
    assert set(finishes) == {None}, finishes


# --- in this process: the engine pauses until the stop asks to abort (no race at all) ---

class Served:
    """``app`` served by a ``ReadyServer`` on a thread; ``signal(sig)`` does what the signal
    handler does."""

    def __init__(self, app, grace: float) -> None:
        self.app = app
        self.server = ReadyServer(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                 log_level="warning"), shutdown_grace=grace)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.url is not None or not self.thread.is_alive(),
                 what="the server to start")
        self.url = self.server.url

    def signal(self, sig: int) -> None:
        self.server.handle_exit(sig, None)

    def join(self) -> None:
        self.thread.join(HANG_S)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture
def app(qwen2_folder):
    return create_app(qwen2_folder, max_batch=2, page_size=4, kv_pages=256)


@pytest.fixture
def serve():
    """``Served(app, grace)``; a server that a failed test left running is stopped."""
    started: list[Served] = []
    yield lambda app, grace: started.append(Served(app, grace)) or started[-1]
    for served in started:
        served.server.should_exit = True
        served.thread.join(HANG_S)


def test_a_stop_refuses_new_requests_then_cuts_the_running_ones_and_frees_pages(
        app, qwen2_folder, monkeypatch, capfd, serve) -> None:
    served = serve(app, grace=HANG_S)  # only the second signal ends the stream
    engine = app.state.serving.engine
    aborted = pause_until_abort(engine, monkeypatch, PAUSE_AT, HANG_S)[0]
    body = {"model": qwen2_folder.name, "prompt": PROMPT, "temperature": 0, "max_tokens": 200}
    stream = Stream(served.url, body)
    stream.first_token()
    served.signal(signal.SIGINT)
    wait_for(lambda: app.state.serving.drain.stopping, what="the stop to begin")
    status, _, text = raw(served.url, "POST", "/v1/completions", body)
    assert status == 503 and json.loads(text)["error"]["code"] == "server_shutdown", text
    status, _, text = raw(served.url, "GET", "/health")
    assert (status, json.loads(text)) == (503, {"status": "stopping"})
    assert not aborted  # the running stream goes on meanwhile
    served.signal(signal.SIGINT)
    assert_cut(stream.rest())
    served.join()
    assert served.server.exit_status == 130
    assert len(aborted) == 1
    err = capfd.readouterr().err
    assert "finishing 1 request (at most 600 s), Ctrl-C again to stop now" in err
    assert "ended 1 request at once" in err and "Traceback" not in err, err
    stats = engine.stats
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0), stats


def test_a_plain_request_cut_by_the_stop_is_a_503(app, qwen2_folder, monkeypatch,
                                                  serve) -> None:
    served = serve(app, grace=0)
    engine = app.state.serving.engine
    pause_until_abort(engine, monkeypatch, PAUSE_AT, HANG_S)
    paused = threading.Event()
    real_step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: (paused.set(), real_step())[1])
    answer: list = []
    body = {"model": qwen2_folder.name, "prompt": PROMPT, "temperature": 0, "max_tokens": 200}
    thread = threading.Thread(
        target=lambda: answer.append(raw(served.url, "POST", "/v1/completions", body)))
    thread.start()
    wait_for(lambda: app.state.serving.drain.running == 1 and paused.is_set(),
             what="the request to run")
    served.signal(signal.SIGTERM)
    thread.join(HANG_S)
    served.join()
    status, _, text = answer[0]
    assert status == 503 and json.loads(text)["error"]["code"] == "server_shutdown", text
    assert served.server.exit_status == 0
    assert engine.stats["pages_used"] == 0


def test_the_openai_client_sees_the_cut(app, qwen2_folder, monkeypatch, serve) -> None:
    served = serve(app, grace=0)
    pause_until_abort(app.state.serving.engine, monkeypatch, PAUSE_AT, HANG_S)
    stream = client(served.url).chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": PROMPT}],
        max_tokens=200, temperature=0, stream=True)
    pieces = []
    with pytest.raises(openai.APIError, match="the server is stopping; the stream was cut"):
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content)
            if pieces[-1] and not app.state.serving.drain.stopping:
                served.signal(signal.SIGTERM)
                wait_for(lambda: app.state.serving.drain.stopping, what="the stop to begin")
    assert any(pieces) and chunk.choices[0].finish_reason == "abort"
    served.join()
    assert served.server.exit_status == 0


# --- `attnlab serve` as a command, with real signals ---

@pytest.fixture(scope="module")
def long_folder(qwen2_folder, tmp_path_factory):
    """The tiny folder with a long context, so that a stream outlasts the stop."""
    folder = tmp_path_factory.mktemp("long-folder")
    for file in qwen2_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class Command:
    """``attnlab serve`` in a subprocess; its stdout's URL, its stderr's lines as they come."""

    def __init__(self, folder, *options: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "attnlab", "serve", "--model", str(folder), "--port", "0",
             "--page-size", "16", "--kv-pages", str(LONG_CONTEXT // 16), *options],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        threading.Thread(target=lambda: [out.put(x) for x in self.process.stdout],
                         daemon=True).start()
        self.reader = threading.Thread(
            target=lambda: [self.err.put(x) for x in self.process.stderr], daemon=True)
        self.reader.start()
        line = out.get(timeout=HANG_S)
        assert line.startswith("attnlab serve: http://127.0.0.1:"), line
        self.url = line.split()[2].removesuffix("/v1")

    def wait_for_line(self, text: str) -> str:
        while True:
            line = self.err.get(timeout=HANG_S)
            self.err_lines.append(line)
            if text in line:
                return line

    def exit_status(self) -> int:
        return self.process.wait(HANG_S)

    def stderr(self) -> str:
        """All of stderr (once the process has exited)."""
        self.reader.join(HANG_S)
        while not self.err.empty():
            self.err_lines.append(self.err.get())
        return "".join(self.err_lines)

    def close(self) -> None:
        self.process.kill()
        self.process.wait(HANG_S)


def test_sigterm_ends_streams_after_the_grace_and_exits_0(long_folder) -> None:
    served = Command(long_folder, "--shutdown-grace", "0")
    try:
        body = {"model": long_folder.name, "prompt": PROMPT, "temperature": 0,
                "max_tokens": LONG_CONTEXT - 100}
        streams = [Stream(served.url, body) for _ in range(2)]
        for stream in streams:
            stream.first_token()
        served.process.send_signal(signal.SIGTERM)
        for stream in streams:
            assert_cut(stream.rest())
        assert served.exit_status() == 0
        err = served.stderr()
        assert "ended 2 requests after the 0 s grace" in err and "attnlab serve: stopped" in err
        assert "Traceback" not in err, err
    finally:
        served.close()


def test_a_request_finishing_within_the_grace_is_answered_in_full(long_folder) -> None:
    served = Command(long_folder, "--shutdown-grace", str(HANG_S))
    try:
        body = {"model": long_folder.name, "prompt": PROMPT, "temperature": 0, "max_tokens": 40}
        stream = Stream(served.url, body)
        stream.first_token()
        served.process.send_signal(signal.SIGTERM)
        payloads = stream.rest()
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] == "length", payloads[-2]
        assert served.exit_status() == 0
        err = served.stderr()
        assert "attnlab serve: stopped" in err and "ended" not in err, err
        assert "Traceback" not in err, err
    finally:
        served.close()


def test_a_second_ctrl_c_stops_at_once_with_status_130(long_folder) -> None:
    served = Command(long_folder, "--shutdown-grace", str(HANG_S))
    try:
        body = {"model": long_folder.name, "messages": [{"role": "user", "content": PROMPT}],
                "temperature": 0, "max_tokens": LONG_CONTEXT - 100}
        stream = Stream(served.url, body, "/v1/chat/completions")
        while not (isinstance(event := stream.next(), dict)
                   and event["choices"][0]["delta"].get("content")):
            assert event is not None, stream.seen
        served.process.send_signal(signal.SIGINT)
        line = served.wait_for_line("stopping")
        assert "finishing 1 request" in line and "Ctrl-C again to stop now" in line, line
        status, _, text = raw(served.url, "GET", "/health")
        assert (status, json.loads(text)) == (503, {"status": "stopping"})
        served.process.send_signal(signal.SIGINT)
        payloads = stream.rest()
        assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == "server_shutdown"
        assert payloads[-3]["choices"][0]["finish_reason"] == "abort", payloads[-3]
        assert served.exit_status() == 130
        err = served.stderr()
        assert "ended 1 request at once" in err and "Traceback" not in err, err
    finally:
        served.close()
