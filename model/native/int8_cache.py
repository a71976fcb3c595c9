"""Python entry points of paged_decode_int8.c, the int8 KV cache's C kernels
(--kv-cache-dtype int8, layout in model/network/kv_int8.py): attention over the cache, and
the writer of new K/V into it, which rounds as kv_int8.py's `quantize` does."""

from __future__ import annotations

import ctypes

import torch

from model.native.build import load_library

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def paged_decode_int8_kernels(
    library: ctypes.CDLL | None = None,
) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """paged_decode_int8.c's attention over an int8 cache, per query dtype: the same
    arguments as `paged_decode_kernels`'."""
    library = library or load_library()
    kernels = {}
    symbols = {torch.bfloat16: "paged_decode_int8_bf16", torch.float32: "paged_decode_int8_f32"}
    for dtype, symbol in symbols.items():
        kernel = getattr(library, symbol)
        kernel.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, *[_I64] * 5, _F32, _I64]
        kernel.restype = ctypes.c_int
        kernels[dtype] = kernel
    return kernels


def kv_int8_writers(
    library: ctypes.CDLL | None = None,
) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """paged_decode_int8.c's writer of K or V rows into an int8 cache's slots, per input
    dtype: (x, row stride in elements, rows, slots, cache, n_kv, head_dim), each row's
    heads contiguous. It rounds as kv_int8.quantize does."""
    library = library or load_library()
    writers = {}
    symbols = {torch.bfloat16: "kv_int8_write_bf16", torch.float32: "kv_int8_write_f32"}
    for dtype, symbol in symbols.items():
        writer = getattr(library, symbol)
        writer.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]
        writer.restype = None
        writers[dtype] = writer
    return writers
