"""``allocator.return_free_pages`` gives freed heap pages back (glibc's ``malloc_trim``): in a
fresh interpreter, temporaries of 4 MiB taken from the heap and freed between live
allocations stay resident until it is called (the allocator module docstring's case)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnlab import allocator
from attnlab.allocator import glibc, return_free_pages

CHURN = """
import torch
from attnlab.allocator import glibc, return_free_pages
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith("RssAnon")) // 1024
# glibc's mapping threshold above 4 MiB, as glibc itself sets it once it has freed a larger
# mapped chunk (M_MMAP_THRESHOLD is -3): the temporaries below then come from the heap
glibc().mallopt(-3, 64 * 2**20)
big, small = [], []
for _ in range(64):  # 256 MiB of temporaries on the heap, each under a live 64 KiB tensor
    big.append(torch.ones(2**20))
    small.append(torch.ones(2**14))
before = anon()
del big
held = anon()
return_free_pages()
print(before, held, anon())
"""


def test_the_c_library_is_asked_only_where_it_can_trim() -> None:
    assert isinstance(return_free_pages(), bool)
    if sys.platform.startswith("linux") and glibc() is None:
        pytest.skip("this Linux's C library has no malloc_trim (not glibc)")


@pytest.mark.skipif(glibc() is None, reason="the C library cannot trim (not glibc)")
def test_freed_temporaries_held_in_the_heap_go_back() -> None:
    run = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    before, held, after = map(int, run.stdout.split())
    assert held > before - 64, f"resident {before} -> {held} MiB: the temporaries were not " \
                               "held in the heap, the case under test did not arise"
    assert after <= held - 200, f"resident {before} -> {held} -> {after} MiB"


@pytest.mark.parametrize("library", ["missing", "not glibc"])
def test_without_glibc_nothing_is_asked_and_false_is_returned(monkeypatch, library) -> None:
    def load(name):
        if library == "missing":
            raise OSError("no C library")
        return object()  # a C library without malloc_trim (musl, macOS)

    monkeypatch.setattr(allocator.ctypes, "CDLL", load)
    allocator.glibc.cache_clear()
    try:
        assert allocator.glibc() is None
        assert return_free_pages() is False
    finally:
        allocator.glibc.cache_clear()
