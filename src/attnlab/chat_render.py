"""Chat templates rendered where a hostile one can be stopped: a worker process with a time
and a memory limit.

A chat template is a Jinja program that comes with a model folder. The sandbox
(``ImmutableSandboxedEnvironment``, as transformers uses) keeps it away from files and from
Python's internals, but not from looping for hours or asking for 10 GB
(``{{ 'a' * 10**10 }}``), and a thread cannot be stopped. So ``TemplateRenderer`` renders in a
worker process: ``RLIMIT_AS`` caps the worker's address space (an allocation over it is a
``MemoryError`` there), and the parent kills the worker at the time limit (the next render
starts a new one). Workers are kept between renders: a normal render costs a pipe round
trip, not a process start. Every failure is a ``ValueError`` naming the template's file.

    renderer = TemplateRenderer(timeout_s=10.0, memory_bytes=2**30)
    text = renderer.render(source, {"messages": [...]}, origin="folder/chat_template.jinja")

The worker is this file run by the interpreter, importing jinja2 and the standard library
only: ``multiprocessing``'s spawn and forkserver start methods import the parent's
``__main__`` in the child, and ``attnlab``'s console script imports torch (a second, and
600 MB of the 1 GiB address space). Requests and answers are JSON lines on its stdin and
stdout, so the variables a template sees are JSON values.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["DEFAULT_RENDERER", "TemplateRenderer", "check_template", "template_variables"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 2**30
# Rendered text longer than this is refused: 4 times the server's default body limit (8 MiB),
# so that a template cannot hand the server hundreds of MB to tokenize.
DEFAULT_MAX_CHARS = 32 * 2**20
# A hang guard for a worker's start (an interpreter and jinja2: well under a second), kept out
# of the time limit so that a busy machine does not turn a slow start into a refused render.
START_TIMEOUT_S = 120.0
# Started with `-c` so that the worker's sys.path does not begin with the folder of this file
# (whose modules would shadow the standard library's) or the current directory.
_BOOT = ("import sys; del sys.path[0]; sys.argv = sys.argv[1:]; import runpy; "
         "runpy.run_path(sys.argv[0], run_name='__main__')")


class TemplateRenderer:
    """Renders Jinja chat templates in up to ``workers`` worker processes, each under
    ``memory_bytes`` of address space, each render under ``timeout_s`` seconds and at most
    ``max_chars`` characters long. Workers start on the first render that needs one (and keep
    the limits they started with; ``timeout_s`` is read at each render); ``close`` ends them."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, workers: int = 2,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        for name, value in (("memory_bytes", memory_bytes), ("workers", workers),
                            ("max_chars", max_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
        self.timeout_s, self.memory_bytes, self.max_chars = timeout_s, memory_bytes, max_chars
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []

    def render(self, source: str, variables: dict[str, object], *, origin: str) -> str:
        """``source`` (Jinja) rendered with ``variables`` (JSON values) in a worker.

        Raises ``ValueError`` starting with ``origin`` (the template's file) when the template
        fails (any exception it raises, a ``MemoryError`` at the memory limit), runs past the
        time limit (its worker is killed) or renders more than ``max_chars`` characters;
        ``TypeError`` naming a variable that is not a JSON value."""
        request = (_dumps({"template": source, "variables": variables}) + "\n").encode()
        with self._slots:
            worker = self._take()
            try:
                answer = worker.exchange(request, time.monotonic() + self.timeout_s)
            except TimeoutError:
                worker.kill()
                raise ValueError(f"{origin}: the chat template did not finish within "
                                 f"{self.timeout_s:g} s (the render's time limit); it was "
                                 "stopped") from None
            except EOFError:
                status = worker.kill()
                raise ValueError(f"{origin}: the chat template's render process ended "
                                 f"(exit status {status})") from None
            except BaseException:  # interrupted mid-exchange: the worker's state is unknown
                worker.kill()
                raise
            with self._lock:
                self._idle.append(worker)
        reply = json.loads(answer)
        if "error" in reply:
            raise ValueError(f"{origin}: the chat template cannot render the messages "
                             f"({reply['error']})")
        return reply["text"]

    def close(self) -> None:
        """End the idle workers (a render in progress keeps its worker until it ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker(self.memory_bytes, self.max_chars)


def check_template(source: str) -> None:
    """Parse ``source`` (in this process: no render, no code generated), raising
    ``jinja2.TemplateSyntaxError`` (or ``RecursionError``, nested too deeply) where it is not
    a template. Only the worker compiles: Jinja's compiler evaluates constant expressions
    (``{{ 'a' * 10**10 }}`` allocates its 10 GB while compiling)."""
    _environment().parse(source)


def template_variables(source: str) -> frozenset[str]:
    """The names of the variables that ``source`` reads (``"messages"``, ``"tools"``, ...;
    also one that it sets before reading): whether a template renders ``tools`` at all. From
    the parse alone, as ``check_template``'s: ``jinja2.meta.find_undeclared_variables`` runs
    the compiler, which evaluates constant expressions (10 GB for ``{{ 'a' * 10**10 }}``)."""
    tree = _environment().parse(source)
    return frozenset(name.name for name in tree.find_all(nodes.Name) if name.ctx == "load")


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders in: sandboxed, ``trim_blocks``/``lstrip_blocks``,
    ``loopcontrols``, ``{% generation %}``, ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that keeps non-ASCII characters."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class _Worker:
    """One worker process and its pipes; ``exchange`` sends a request line and reads the
    answer line by a deadline."""

    def __init__(self, memory_bytes: int, max_chars: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, __file__, str(memory_bytes), str(max_chars)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for pipe in (self.process.stdin, self.process.stdout):
            os.set_blocking(pipe.fileno(), False)
        try:
            ready = self.exchange(b"", time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError):
            status = self.kill()
            raise OSError(f"the chat template's render process did not start (exit status "
                          f"{status})") from None
        assert ready == b"ready\n", ready

    def exchange(self, request: bytes, deadline: float) -> bytes:
        """Write ``request``, read one line; ``TimeoutError`` past ``deadline``
        (``time.monotonic``), ``EOFError`` when the worker has ended."""
        stdin, stdout = self.process.stdin.fileno(), self.process.stdout.fileno()
        left, answer = memoryview(request), bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if left:
                selector.register(stdin, selectors.EVENT_WRITE)
            while not answer.endswith(b"\n"):
                wait = deadline - time.monotonic()
                if wait <= 0:
                    raise TimeoutError
                for key, _ in selector.select(wait):
                    if key.fd == stdin:
                        try:
                            left = left[os.write(stdin, left):]
                        except BrokenPipeError:
                            raise EOFError from None
                        except BlockingIOError:
                            continue
                        if not left:
                            selector.unregister(stdin)
                    else:
                        chunk = os.read(stdout, 1 << 20)
                        if not chunk:
                            raise EOFError
                        answer += chunk
        return bytes(answer)

    def kill(self) -> int:
        """Kill the worker; its exit status."""
        self.process.kill()
        return self._reap()

    def stop(self) -> None:
        """Close its stdin (the worker exits at the end of its input)."""
        self.process.stdin.close()
        try:
            self.process.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process.stdout.close()

    def _reap(self) -> int:
        status = self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()
        return status


def _dumps(request: dict) -> str:
    try:
        return json.dumps(request, ensure_ascii=False)
    except (TypeError, ValueError):
        for name, value in request["variables"].items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as error:
                raise TypeError(f"{name}: a chat template's variables must be JSON values "
                                f"(str, int, float, bool, None, lists and dicts of them with "
                                f"str keys), got {type(value).__name__} ({error})") from None
        raise


class _GenerationTag(Extension):
    """``{% generation %} ... {% endgeneration %}`` (transformers' assistant-mask tag) renders
    its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _serve(memory_bytes: int, max_chars: int) -> None:
    """The worker's loop: one JSON request per stdin line, one JSON answer per stdout line
    (``{"text": ...}`` or ``{"error": ...}``), until stdin ends."""
    import resource  # POSIX only, and only the worker needs it

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ValueError, OSError) as error:  # e.g. macOS: the time limit still holds
        print(f"attnlab: note: chat templates render without a memory limit ({error})",
              file=sys.stderr)
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    templates: dict[str, jinja2.Template] = {}
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            source = request["template"]
            if source not in templates:
                if len(templates) >= 8:  # a server renders one template; a test, a few
                    templates.clear()
                templates[source] = _environment().from_string(source)
            text = templates[source].render(**request["variables"])
            answer = {"text": text} if len(text) <= max_chars else {
                "error": f"it renders {len(text)} characters, more than the limit of "
                         f"{max_chars}"}
        except MemoryError as error:
            answer = {"error": _describe(error, f"more than the render's memory limit of "
                                                f"{memory_bytes / 2**20:g} MiB")}
        except Exception as error:  # the template's: every one is a refusal of this render
            answer = {"error": _describe(error)}
        out.write(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
        out.flush()


def _exit_with(parent: int) -> None:
    """End the worker when its parent has gone (even by SIGKILL): a looping template would
    not read the end of its input."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _describe(error: BaseException, message: str = "") -> str:
    """``Type, template line N: message`` on one line (at most 300 characters of message;
    ``message`` when given, else the error's), the line where the traceback passes through
    the template."""
    line, frame = None, error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<template>":
            line = frame.tb_lineno
        frame = frame.tb_next
    message = " ".join((message or str(error)).split())
    if len(message) > 300:
        message = message[:297] + "..."
    where = "" if line is None else f", template line {line}"
    return f"{type(error).__name__}{where}" + (f": {message}" if message else "")


DEFAULT_RENDERER = TemplateRenderer()
atexit.register(DEFAULT_RENDERER.close)

if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
