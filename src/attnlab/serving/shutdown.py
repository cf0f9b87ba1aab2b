"""How ``attnlab serve`` stops: it stops admitting, lets the running requests finish for a
grace period, then ends the rest.

    drain = Drain()                  # one per app (ServerState.drain)
    drain.add(events)                # a handler's event queue, while its request runs
    drain.stop_admitting()           # new requests are answered 503 from now on
    await drain.idle(grace)          # True if every running request finished in time
    drain.cut("the server is stopping")   # the others end now (a final chunk, or a 503)

``cut`` puts a ``ShutdownError`` into each running request's event queue; the handler ends its
answer there (a stream: a last chunk per unfinished choice with ``finish_reason: "abort"``,
OpenAI's error object, ``[DONE]``; a plain answer: a 503) and aborts its engine requests, which
frees their KV cache pages.
"""

from __future__ import annotations

import asyncio

__all__ = ["Drain", "ShutdownError"]


class ShutdownError(Exception):
    """Put in a request's event queue to end it: the server is stopping."""


class Drain:
    """The running requests' event queues, and whether the server still admits new ones."""

    def __init__(self) -> None:
        self.stopping = False  # no new request is admitted
        self._cut: ShutdownError | None = None
        self._running: set[asyncio.Queue] = set()
        self._changed: asyncio.Event | None = None

    @property
    def running(self) -> int:
        return len(self._running)

    def add(self, events: asyncio.Queue) -> None:
        """``events`` (a request's queue) runs until ``remove``; after a ``cut`` it is ended at
        once (a request admitted just before the stop began)."""
        self._running.add(events)
        if self._cut is not None:
            events.put_nowait(self._cut)

    def remove(self, events: asyncio.Queue) -> None:
        self._running.discard(events)
        if self._changed is not None:
            self._changed.set()

    def stop_admitting(self) -> None:
        self.stopping = True

    def cut(self, reason: str) -> int:
        """End every running request with ``ShutdownError(reason)``; how many there were."""
        self._cut = ShutdownError(reason)
        for events in self._running:
            events.put_nowait(self._cut)
        return len(self._running)

    async def idle(self, timeout: float | None, until: asyncio.Event | None = None) -> bool:
        """Wait until no request runs (True), or ``timeout`` seconds pass, or ``until`` is set
        (False)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._running:
            if until is not None and until.is_set():
                return False
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            self._changed = asyncio.Event()
            waits = [asyncio.ensure_future(self._changed.wait())]
            if until is not None:
                waits.append(asyncio.ensure_future(until.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return True
