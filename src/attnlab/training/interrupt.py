"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (``kill``, ``timeout``,
job schedulers).

While a ``StopRequests`` is entered, the first signal only sets ``signum``: the loop finishes
its step, saves and stops, so a checkpoint never holds half a step. A second signal aborts at
once (``KeyboardInterrupt``, nothing saved, the previous checkpoint stays), except inside
``saving()``, where it is only noted: a save is never cut short. The previous handlers come
back on exit. Outside the main thread Python cannot install handlers and nothing changes.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["StopRequests", "TrainingInterrupted"]


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal at a step boundary; ``saved`` is the checkpoint written
    there (None when there is no output folder). ``exit_code`` is ``128 + signum`` (130 for
    SIGINT, 143 for SIGTERM), the shell's convention."""

    def __init__(self, signum: int, step: int, saved: Any) -> None:
        super().__init__(f"stopped by signal {signum} after step {step}")
        self.signum, self.step, self.saved = signum, step, saved
        self.exit_code = 128 + signum


class StopRequests:
    """Context manager that turns SIGINT and SIGTERM into a stop request (``signum``)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saving = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within this block a signal is noted but never interrupts."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving "
                  "(send it again to stop at once without saving)", file=sys.stderr, flush=True)
        elif self._saving:
            print("\nsaving the checkpoint; it takes a moment", file=sys.stderr, flush=True)
        else:
            raise KeyboardInterrupt
