"""Which pages of a range of this process's memory are resident, asked of the kernel with
mincore(2): unlike the process's RSS, the answer does not move with what other threads of a
test worker allocate or free at the same time."""

import ctypes
import ctypes.util
import mmap

import torch


def resident_pages(address: int, length: int) -> list[bool]:
    """mincore(2) over [address, address + length): which pages are in memory."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = address - address % mmap.PAGESIZE
    pages = (address + length - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), address + length - start, vec) == 0
    return [bool(v & 1) for v in vec]


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages under a contiguous tensor that are in memory."""
    return sum(resident_pages(tensor.data_ptr(), tensor.nbytes)) * mmap.PAGESIZE
