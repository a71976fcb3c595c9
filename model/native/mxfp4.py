"""The C MXFP4 matmul's entry points: fp32 or bf16 rows times a weight held in GGUF's MXFP4
blocks, as the file stores them; the rows kept in fp32 (mxfp4_matmul.c) or rounded to int8
per block of 32 (mxfp4_matmul_a8.c)."""

from __future__ import annotations

import ctypes

import torch

from model.native.build import load_library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class NativeMxfp4Matmul:
    """x [rows, in] fp32 or bf16 (each row contiguous) times an MXFP4 weight [out, in / 32 *
    17] uint8; the output in x's dtype. `int8_activations`: x rounded to int8 per block of
    32 first. Raises NativeUnavailable where the library cannot be built."""

    def __init__(self, library: ctypes.CDLL | None = None, int8_activations: bool = False) -> None:
        library = library or load_library()
        self.kernels: dict[torch.dtype, ctypes._CFuncPtr] = {}
        prefix = "mxfp4_matmul_a8" if int8_activations else "mxfp4_matmul"
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            kernel = getattr(library, f"{prefix}_{suffix}")
            kernel.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
            kernel.restype = ctypes.c_int
            self.kernels[dtype] = kernel
        kind = getattr(library, f"{prefix}_kind")
        kind.restype = ctypes.c_char_p
        # Which loop the build compiled: "avx512" (fp32) or "avx512_vnni" (int8), "avx2" or
        # "portable".
        self.kind: str = kind().decode()
        # bf16 rows' loop: "avx512_bf16" (dpbf16) where built, else the fp32 rows' one.
        self.bf16_kind = self.kind
        if not int8_activations:
            bf16_kind = library.mxfp4_matmul_bf16_kind
            bf16_kind.restype = ctypes.c_char_p
            self.bf16_kind = bf16_kind().decode()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, in], fp32 or bf16; returns [rows, out] in x's dtype."""
        rows, in_features = x.shape
        if x.stride(1) != 1 or x.dtype not in self.kernels:
            x = x.contiguous().to(torch.float32 if x.dtype not in self.kernels else x.dtype)
        out = torch.empty(rows, out_features, dtype=x.dtype)
        pointers = (x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr())
        if self.kernels[x.dtype](*pointers, rows, out_features, in_features):
            raise MemoryError("mxfp4_matmul: out of memory for its buffers")
        return out
