"""Weight buffers on 2 MB pages: `empty_on_huge_pages` gives an empty CPU tensor whose
2 MB-aligned span the kernel is asked (madvise MADV_HUGEPAGE) to back with transparent huge
pages when it is first written, as the loader then does.

A decode step streams every weight it uses once (a gpt-oss-shape step about 1.1 GB), and
on 4 KB pages that is a TLB miss every 4 KB. The grouped-int8 product of one row over
[5120 x 2880] read from memory on one thread of the 2-core AVX-512 EPYC: 0.86 ms (median)
on 4 KB pages, 0.64 on 2 MB ones, what it takes with the weight in cache; the MXFP4
product, bound by its arithmetic on one thread, the same either way.

Asked before the first write, nothing is copied: the pages are huge from the start.
Where the kernel has no huge page free, or THP is off (`never`), or this is not Linux,
the buffer is an ordinary one. The slack before the aligned start is never written, so
never resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import platform
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's value on every architecture


@cache
def _madvise() -> ctypes._CFuncPtr | None:
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        advise = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks for huge pages over the 2 MB pages wholly inside `tensor`'s bytes; True if the
    kernel took the advice (it applies to pages not yet written)."""
    advise = _madvise()
    start = -tensor.data_ptr() % HUGE_PAGE
    length = (tensor.nbytes - start) // HUGE_PAGE * HUGE_PAGE
    if advise is None or tensor.device.type != "cpu" or length <= 0:
        return False
    return advise(tensor.data_ptr() + start, length, MADV_HUGEPAGE) == 0


def empty_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """torch.empty(shape, dtype, device), on the CPU from 2 MB on starting at a 2 MB
    boundary with huge pages asked for; elsewhere torch.empty itself."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or _madvise() is None:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    advise_huge_pages(tensor)
    return tensor
