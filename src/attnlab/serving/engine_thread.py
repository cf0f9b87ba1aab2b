"""The one thread that drives an ``Engine``, and the bridge from it to the asyncio handlers.

Every call into the engine (``add_request``, ``abort``, ``step``, ``stats``) runs on this
thread, so the engine needs no locks: a handler submits a command and awaits its answer, and
the thread runs the commands between steps. While there is work it calls ``step()`` and hands
each ``TokenEvent`` to the asyncio queue of its request on the handler's event loop
(``loop.call_soon_threadsafe``); with no work it sleeps until a command arrives.

An exception from ``step()`` fails the requests in flight (their queues receive an
``EngineError``, the engine is asked to abort them) and the thread goes on serving.

The thread that loaded the model should call ``release_openmp_threads()`` before the engine
thread steps (``create_app`` does): see there why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from attnlab.serving import Engine, SamplingParams, TokenEvent

__all__ = ["EngineError", "EngineThread", "release_openmp_threads"]

_log = logging.getLogger("attnlab.serve")


class EngineError(RuntimeError):
    """Put in a request's queue instead of a ``TokenEvent`` when the engine failed under it."""


class EngineThread:
    """Owns ``engine``; ``start()`` it on the thread that will ``stop()`` it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="attnlab-engine", daemon=True)
        self.stats: dict[str, int] = engine.stats()  # replaced (never mutated) after each step
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step, freeing the pages of every request left."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def add(self, prompt_ids: list[int], params: SamplingParams,
                  events: asyncio.Queue) -> str:
        """Add a request whose events go to ``events``; its id. Raises what
        ``Engine.add_request`` raises (``ValueError``, ``QueueFull``)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def reply(request_id: str | None, error: BaseException | None) -> None:
            if answer.cancelled():  # the handler is gone (client disconnected)
                if request_id is not None:
                    self.abort(request_id)
            elif error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(request_id)

        def command() -> None:
            try:
                request_id = self.engine.add_request(prompt_ids, params)
            except Exception as error:  # handed to the handler, which answers 400/429/500
                loop.call_soon_threadsafe(reply, None, error)
                return
            self._streams[request_id] = (loop, events)
            loop.call_soon_threadsafe(reply, request_id, None)

        self._submit(command)
        return await answer

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (its pages are freed); no more events reach its queue."""

        def command() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(command)

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.alive:
            raise EngineError("the engine thread is not running")
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                self._run_commands()
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                else:
                    self.stats = self.engine.stats()
                    self._wake.wait()
                    continue
                self.stats = self.engine.stats()
            except Exception as error:
                self._fail_all(error)
        self._release_all()

    def _release_all(self) -> None:
        """On stopping: run the commands still queued (the aborts of the requests that the
        server ended), abort whatever still runs, and step once to free their pages."""
        try:
            self._run_commands()
            for request_id in self._streams:
                self.engine.abort(request_id)
            self._streams = {}
            if self.engine.has_work():
                self.engine.step()
            self.stats = self.engine.stats()
        except Exception:
            _log.exception("releasing the requests left at stop")

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, events: list[TokenEvent]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for event in events:
            target = self._streams.get(event.request_id)
            if target is None:
                continue
            by_loop.setdefault(target[0], []).append((target[1], event))
            if event.finish_reason is not None:
                del self._streams[event.request_id]
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: Exception) -> None:
        """Fail every request in flight; the engine's state for them is not to be trusted."""
        self.failures += 1
        _log.exception("engine failure; failing the %d requests in flight", len(self._streams))
        failure = EngineError(f"the engine failed: {type(error).__name__}: {error}")
        streams, self._streams = self._streams, {}
        for request_id, (loop, events) in streams.items():
            _call_soon(loop, _put_all, [(events, failure)])
            try:
                self.engine.abort(request_id)
            except Exception:
                _log.exception("abort of %s after the engine failure", request_id)


def release_openmp_threads() -> bool:
    """Let the OpenMP worker threads that the calling thread started exit (libgomp's
    ``omp_pause_resource_all(omp_pause_hard)``); True if they were released, False where
    PyTorch runs on another OpenMP runtime or none.

    libgomp keeps a pool of worker threads for each thread that starts parallel work. The
    server loads the model (calibration included) on one thread and steps it on another; with
    both pools alive there are more OpenMP threads than cores, libgomp stops spin-waiting and
    every parallel region of a step pays a futex wake-up: on the 2-core bench machine 30-80 us
    a region, a float32 decoding step 27.5 -> 30 ms. The calling thread gets a new pool if it
    starts parallel work again.
    """
    pause = _omp_pause_all()
    return pause is not None and pause(2) == 0  # 2: omp_pause_hard


@functools.cache
def _omp_pause_all() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp that this process loaded (PyTorch's), if any."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    paths = sorted({line.split()[-1] for line in maps.read_text().splitlines()
                    if "/libgomp" in line})
    if len(paths) != 1:  # none, or two runtimes: which one PyTorch uses is not known here
        return None
    return getattr(ctypes.CDLL(paths[0]), "omp_pause_resource_all", None)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for events, item in items:
        events.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the server is shutting down
        loop.call_soon_threadsafe(fn, *args)
