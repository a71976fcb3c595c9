"""Handing the C heap's free pages back to the kernel after start-up work.

Loading a checkpoint allocates and frees thousands of temporaries (dequantised tensors,
staging buffers, the format measurement's layers); glibc keeps the freed memory in its
heap, where it stays resident for the server's whole life: on the default model 134 MB
of the 700 MB a freshly loaded server held. `malloc_trim` returns it. Elsewhere than
glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def return_free_heap() -> bool:
    """True if glibc released memory to the kernel."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
