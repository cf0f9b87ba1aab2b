"""The chat template's worker process: every failure of a template is a ValueError naming its
file, a huge allocation is refused by the worker's memory limit (nothing of it is allocated
here), a template that loops is killed at the time limit and the next render gets a new
worker, and a worker does not outlive its parent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from attnlab import chat_render
from attnlab.chat_render import TemplateRenderer

ORIGIN = "folder/chat_template.jinja"
HANG_S = 600.0  # a hang guard: far above any render here on a busy 2-core machine
NESTED_LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}"
               "{% endfor %}")
FLOOD = "{{ 'a' * 10**10 }}"  # 10 GB: the worker's 1 GiB limit refuses it at once
WORKER = chat_render._Worker


@pytest.fixture
def renderer():
    renderer = TemplateRenderer(timeout_s=HANG_S)
    yield renderer
    renderer.close()


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every worker started during the test, in order."""
    started = []

    def spy(*args):
        worker = WORKER(*args)
        started.append(worker)
        return worker

    monkeypatch.setattr(chat_render, "_Worker", spy)
    return started


def test_renders_as_transformers_filters_and_globals(renderer) -> None:
    source = ("{% generation %}{{ messages | tojson }}{% endgeneration %}"
              "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
              "{{ m['content'] }}{% endfor %}{{ strftime_now('%Y') | length }}")
    messages = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "你好"}]
    text = renderer.render(source, {"messages": messages}, origin=ORIGIN)
    assert text == '[{"role": "user", "content": "héllo"}, {"role": "user", "content": ' \
                   '"你好"}]你好4'


@pytest.mark.parametrize(("source", "error"), [
    ("{% include 'other.jinja' %}", r"TypeError, template line 1: no loader"),
    ("{% import 'macros.jinja' as m %}", r"TypeError, template line 1: no loader"),
    ("{{ 'a' + 1 }}", r"TypeError, template line 1: can only concatenate str"),
    ("line one\n{{ 1 / 0 }}", r"ZeroDivisionError, template line 2: division by zero"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", r"RecursionError, template line 1"),
    ("{{ raise_exception('only user and assistant') }}",
     r"TemplateError, template line 1: only user and assistant"),
    ("{{ messages[0]['content'] + 1 }}", r"UndefinedError, template line 1"),
])
def test_every_template_failure_is_a_value_error_naming_the_file(renderer, source,
                                                                  error) -> None:
    with pytest.raises(ValueError, match=rf"^{ORIGIN}: the chat template cannot render the "
                       rf"messages \({error}"):
        renderer.render(source, {"messages": []}, origin=ORIGIN)
    assert renderer.render("{{ x }}", {"x": "still serving"}, origin=ORIGIN) == "still serving"


def test_a_huge_allocation_is_refused_by_the_memory_limit(renderer, workers) -> None:
    with pytest.raises(ValueError, match=rf"^{ORIGIN}: .*\(MemoryError, template line 1: more "
                       r"than the render's memory limit of 1024 MiB\)"):
        renderer.render(FLOOD, {}, origin=ORIGIN)
    assert renderer.render("{{ 'a' * 1000 }}", {}, origin=ORIGIN) == "a" * 1000
    assert len(workers) == 1  # a MemoryError leaves the worker usable


def test_a_loop_is_killed_at_the_time_limit_and_the_worker_replaced(renderer, workers) -> None:
    renderer.timeout_s = 0.5
    with pytest.raises(ValueError, match=rf"^{ORIGIN}: the chat template did not finish within "
                       r"0.5 s \(the render's time limit\); it was stopped"):
        renderer.render(NESTED_LOOP, {}, origin=ORIGIN)
    assert workers[0].process.poll() is not None  # killed, not left looping
    renderer.timeout_s = HANG_S
    assert renderer.render("{{ 6 * 7 }}", {}, origin=ORIGIN) == "42"
    assert len(workers) == 2


def test_a_worker_that_dies_is_a_value_error_and_replaced(renderer, workers) -> None:
    sent = threading.Event()
    real = WORKER.exchange

    def exchange(self, request, deadline):
        if request:
            sent.set()
        return real(self, request, deadline)

    errors: list[Exception] = []

    def hostile() -> None:
        try:
            renderer.render(NESTED_LOOP, {}, origin=ORIGIN)
        except ValueError as error:
            errors.append(error)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WORKER, "exchange", exchange)
        thread = threading.Thread(target=hostile)
        thread.start()
        assert sent.wait(HANG_S)
        workers[0].process.send_signal(signal.SIGKILL)
        thread.join(HANG_S)
    assert len(errors) == 1 and re.match(rf"^{ORIGIN}: the chat template's render process "
                                         r"ended \(exit status -9\)", str(errors[0]))
    assert renderer.render("ok", {}, origin=ORIGIN) == "ok" and len(workers) == 2


def test_long_output_and_non_json_variables_are_refused(renderer) -> None:
    small = TemplateRenderer(max_chars=100)
    try:
        assert small.render("{{ 'a' * 100 }}", {}, origin=ORIGIN) == "a" * 100
        with pytest.raises(ValueError, match=rf"^{ORIGIN}: .*\(it renders 101 characters, "
                           r"more than the limit of 100\)"):
            small.render("{{ 'a' * 101 }}", {}, origin=ORIGIN)
    finally:
        small.close()
    with pytest.raises(TypeError, match=r"^tools: a chat template's variables must be JSON "
                       r"values .* got set"):
        renderer.render("x", {"messages": [], "tools": {1, 2}}, origin=ORIGIN)


@pytest.mark.parametrize(("option", "value"), [("timeout_s", 0), ("timeout_s", "10"),
                                                ("memory_bytes", 0), ("workers", 1.5),
                                                ("max_chars", True)])
def test_bad_options_are_refused_by_name(option, value) -> None:
    with pytest.raises(ValueError, match=rf"^{option}: expected"):
        TemplateRenderer(**{option: value})


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc (Linux)")
def test_a_worker_ends_with_its_parent(tmp_path) -> None:
    """A parent killed (SIGKILL: no clean-up runs) while its worker loops: the worker sees it
    and exits, instead of looping on with nobody to read its answer."""
    script = tmp_path / "parent.py"
    request = json.dumps({"template": NESTED_LOOP, "variables": {}}).encode() + b"\n"
    script.write_text(
        "import time\n"
        "from attnlab.chat_render import _Worker\n"
        "worker = _Worker(2**30, 100)\n"
        f"request = {request!r}\n"
        "try:\n"
        "    worker.exchange(request, time.monotonic() + 0.1)\n"
        "except TimeoutError:\n"
        "    print(worker.process.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    wait_until_gone(pid)


def wait_until_gone(pid: int) -> None:
    status = f"/proc/{pid}/status"
    deadline = threading.Event()
    timer = threading.Timer(HANG_S, deadline.set)
    timer.start()
    try:
        while not deadline.wait(0.05):
            try:
                with open(status, encoding="utf-8") as file:
                    if "State:\tZ" in file.read():  # exited, not yet reaped by its new parent
                        return
            except FileNotFoundError:
                return
        raise AssertionError(f"worker {pid} still runs {HANG_S} s after its parent was killed")
    finally:
        timer.cancel()


def test_template_variables_are_found_without_rendering() -> None:
    """What a template reads, from its parse alone: whether it renders tools, also where it
    first checks `tools is defined` (Llama 3.1's); a huge constant is never evaluated (the
    compiler would, in this process)."""
    assert chat_render.template_variables(
        "{% for m in messages %}{{ m.content }}{% endfor %}") == {"messages", "m"}
    assert "tools" in chat_render.template_variables(
        "{% if not tools is defined %}{% set tools = none %}{% endif %}{{ tools }}")
    assert chat_render.template_variables("{{ 'a' * 10**10 }}{{ tools }}") == {"tools"}
