"""The C allocator's free pages, given back to the system.

glibc's ``malloc`` keeps freed chunks in its heaps. After it frees a chunk that it had mapped
on its own (a float32 temporary of a few MiB is one), it raises its mapping threshold to that
size, so later temporaries of that size come from a heap; a heap whose top is held by a live
allocation (the codes of a block quantized just before) then keeps the freed temporaries'
pages resident. Quantizing a model block by block, a long run of such temporaries, so
raised the peak resident memory of a streamed load 1.6-3x in some runs of the same load and
not in others. ``malloc_trim(0)`` gives back every whole free page of every heap. Another C
library has no such function and nothing to do.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["glibc", "return_free_pages"]


def return_free_pages() -> bool:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim(0)``);
    whether any went back (``False`` also where the C library is not glibc)."""
    libc = glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library this process runs on when it is glibc (``malloc_trim``, ``mallopt``),
    else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (AttributeError, OSError, TypeError):  # not glibc; Windows takes no None
        return None
    return libc
