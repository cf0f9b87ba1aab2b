"""``release_openmp_threads``: the loading thread's OpenMP workers exit before the engine thread
steps, so that two pools of workers do not share the cores (libgomp then stops spin-waiting
and every parallel region pays a wake-up)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from server_live import wait_for

from attnlab.serving.engine_thread import release_openmp_threads

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
