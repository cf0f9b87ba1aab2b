"""``release_openmp_threads``: the loading thread's OpenMP workers exit before the engine thread
steps, so that two pools of workers do not share the cores (libgomp then stops spin-waiting
and every parallel region pays a wake-up). ``EngineThread.stop`` frees the pages of the
requests left."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch
from server_live import HANG_S, wait_for

from attnlab.models.io import from_pretrained
from attnlab.serving import Engine, SamplingParams
from attnlab.serving.engine_thread import EngineThread, release_openmp_threads

TASKS = Path("/proc/self/task")


def _threads() -> int:
    return len(os.listdir(TASKS))


@pytest.mark.skipif(not TASKS.exists() or torch.get_num_threads() < 2,
                    reason="needs /proc and two torch threads")
def test_release_openmp_threads_lets_this_threads_workers_exit() -> None:
    x = torch.randn(2_000_000)
    expected = x.sum()  # a parallel region: this thread's pool of workers exists now
    before = _threads()
    if not release_openmp_threads():
        pytest.skip("PyTorch does not run on libgomp here")
    wait_for(lambda: _threads() < before, what="the OpenMP workers to exit")
    assert torch.equal(x.sum(), expected)  # parallel work still runs, on a new pool


def test_stop_frees_the_pages_of_the_requests_left(qwen2_folder) -> None:
    """A request still running when the thread stops is aborted and its pages are freed
    (the server ends its requests first; this is what is left)."""
    engine = Engine(from_pretrained(qwen2_folder), max_batch=2, page_size=4, kv_pages=64)
    thread = EngineThread(engine)
    thread.start()
    stepped = threading.Event()
    real_step = engine.step
    # The first token pauses the thread until stop() is called: the request is mid-way then.
    engine.step = lambda: (real_step(), stepped.set(), stopping.wait(HANG_S))[0]
    stopping = threading.Event()

    async def run() -> None:
        events: asyncio.Queue = asyncio.Queue()
        await thread.add([1, 2, 3], SamplingParams(max_tokens=200, temperature=0), events)
        await asyncio.get_running_loop().run_in_executor(None, stepped.wait, HANG_S)

    asyncio.run(run())
    assert engine.stats()["pages_used"] > 0
    stopping.set()
    thread.stop(HANG_S)
    assert not thread.alive
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0), stats
