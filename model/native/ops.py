"""Python entry points of the native kernels: every ctypes signature of the library but
the decoder layer's (model/native/layer.py) and the int8 KV cache's
(model/native/int8_cache.py) is declared here."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from model.native.build import load_library
from model.native.huge_pages import empty_on_huge_pages

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class NativeRmsNorm:
    """RMSNorm in C (rms_norm.c): the formula and bf16 roundings of the model's own, in one
    call. Raises NativeUnavailable where the library cannot be built."""

    def __init__(self) -> None:
        library = load_library()
        self.kernels: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, symbol in ((torch.bfloat16, "rms_norm_bf16"), (torch.float32, "rms_norm_f32")):
            kernel = getattr(library, symbol)
            kernel.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
            kernel.restype = None
            self.kernels[dtype] = kernel

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """None where the kernel does not apply (another dtype or device, or a strided x):
        the caller then runs the PyTorch version."""
        kernel = self.kernels.get(x.dtype)
        if (
            kernel is None
            or weight.dtype != x.dtype
            or x.device.type != "cpu"
            or not (x.is_contiguous() and weight.is_contiguous())
        ):
            return None
        out = torch.empty_like(x)
        width = x.shape[-1]
        kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps)
        return out


def paged_decode_kernels(library: ctypes.CDLL | None = None) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """paged_decode.c's entry points per dtype, for the cpu_paged attention backend (which
    documents the arguments). Raises NativeUnavailable where the library cannot be built."""
    library = library or load_library()
    kernels = {}
    symbols = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
    for dtype, symbol in symbols.items():
        kernel = getattr(library, symbol)
        kernel.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, *[_I64] * 5, _F32]
        kernel.argtypes += [_I64, _PTR]  # window, sinks (None: none)
        kernel.restype = ctypes.c_int
        kernels[dtype] = kernel
    return kernels


class _TiledMatmul:
    """Calls a tiled weight-only matmul of the library (int4_matmul.c, int8_matmul.c): bf16
    rows in, `out_dtype` rows out. Raises NativeUnavailable where the library cannot be
    built."""

    symbol: str
    out_dtype: torch.dtype

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        library = library or load_library()
        self.kernel = getattr(library, f"{self.symbol}_bf16")
        self.kernel.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
        self.kernel.restype = ctypes.c_int
        kind = getattr(library, f"{self.symbol}_kind")
        kind.restype = ctypes.c_char_p
        # Which loop the build compiled: "avx512_bf16", "avx512_vnni", "avx2" or "portable".
        self.kind: str = kind().decode()

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        """x [rows, in] bf16, each row contiguous; returns [rows, out]."""
        rows, in_features = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(rows, out_features, dtype=self.out_dtype)
        pointers = (x.data_ptr(), x.stride(0), weight.data_ptr(), scales.data_ptr())
        if self.kernel(*pointers, out.data_ptr(), rows, out_features, in_features):
            raise MemoryError(f"{self.symbol}: out of memory for its buffers")
        return out


class NativeInt4Matmul(_TiledMatmul):
    """Weight-only int4 matmul in C (int4_matmul.c) on its own tiled layout, made by `pack`;
    bf16 output."""

    symbol, out_dtype = "int4_matmul", torch.bfloat16

    @staticmethod
    def pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] uint8 in 0..15; scales_and_zeros [in / 32, out, 2] bf16. Returns the
        kernel's weight bytes and scales, in the tile order int4_matmul.c describes (in C:
        the same reordering by tensor ops took 2.7 of the 18 s a 1.5B model loaded in)."""
        out_features, in_features = q.shape
        q, scales_and_zeros = q.contiguous(), scales_and_zeros.contiguous()
        weight = empty_on_huge_pages((out_features * in_features // 2,), torch.uint8, "cpu")
        tiled = empty_on_huge_pages(
            (out_features * (in_features // 32) * 2,), torch.bfloat16, "cpu"
        )
        pointers = (q.data_ptr(), scales_and_zeros.data_ptr(), weight.data_ptr(), tiled.data_ptr())
        _int4_pack()(*pointers[:2], out_features, in_features, *pointers[2:])
        return weight, tiled


@cache
def _int4_pack() -> ctypes._CFuncPtr:
    function = load_library().int4_pack
    function.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR]
    function.restype = None
    return function


class NativeInt4A8Matmul(_TiledMatmul):
    """int4 weights in NativeInt4Matmul's layout times int8 activations, quantised per row
    in groups of 32 inside the call (int4_matmul_a8.c); bf16 output."""

    symbol, out_dtype = "int4_matmul_a8", torch.bfloat16


def native_int4_matmul(kernel: str) -> NativeInt4Matmul | NativeInt4A8Matmul:
    """The C int4 matmul named by an Int4Linear kernel: "native" or "native_a8"."""
    return NativeInt4A8Matmul() if kernel == "native_a8" else NativeInt4Matmul()


class NativeInt5Matmul(_TiledMatmul):
    """Weight-only 5-bit matmul in C (int5_matmul.c): symmetric groups of 32 with fp16
    scales, GGUF's Q5_0 exactly; bf16 output."""

    symbol, out_dtype = "int5_matmul", torch.bfloat16

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        library = library or load_library()
        super().__init__(library)
        self._pack = library.int5_pack
        self._pack.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR]
        self._pack.restype = None

    def pack(self, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] uint8 in 0..31, contiguous; scales [out, in / 32] fp16. Returns the
        kernel's weight bytes and scales, in the tile order int5_matmul.c describes."""
        out_features, in_features = q.shape
        weight = empty_on_huge_pages((out_features * in_features * 5 // 8,), torch.uint8, "cpu")
        tiled_scales = torch.empty(out_features * (in_features // 32), dtype=torch.float16)
        scales = scales.to(torch.float16).contiguous()
        pointers = (q.data_ptr(), scales.data_ptr(), weight.data_ptr(), tiled_scales.data_ptr())
        self._pack(*pointers[:2], out_features, in_features, *pointers[2:])
        return weight, tiled_scales


class NativeInt5A8Matmul(_TiledMatmul):
    """5-bit weights in NativeInt5Matmul's layout times int8 activations, quantised per row
    in groups of 32 inside the call (int5_matmul_a8.c); bf16 output."""

    symbol, out_dtype = "int5_matmul_a8", torch.bfloat16


class NativeInt6Matmul(_TiledMatmul):
    """Weight-only 6-bit matmul in C (int6_matmul.c): GGUF's Q6_K exactly, sub-blocks of 16
    with an int8 scale each under an fp32 one per 256; bf16 output."""

    symbol, out_dtype = "int6_matmul", torch.bfloat16

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        library = library or load_library()
        super().__init__(library)
        self._pack = library.int6_pack
        self._pack.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR]
        self._pack.restype = None

    def pack(
        self,
        q: torch.Tensor,
        sub_scales: torch.Tensor,
        scales: torch.Tensor,
        weight: torch.Tensor | None = None,
        tiled: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] uint8 in 0..63; sub_scales [out, in / 16] int8; scales [out, in /
        256] fp32. Returns the kernel's weight bytes and scales, in the tile order
        int6_matmul.c describes: written into `weight` and `tiled` where given
        (contiguous, of those sizes), so that rows can be packed where the whole weight's
        bytes will be."""
        out_features, in_features = q.shape
        q, sub_scales, scales = q.contiguous(), sub_scales.contiguous(), scales.contiguous()
        if weight is None or tiled is None:
            weight = empty_on_huge_pages(
                (out_features * in_features * 13 // 16,), torch.uint8, "cpu"
            )
            tiled = torch.empty(out_features * (in_features // 256), dtype=torch.float32)
        if weight.numel() != out_features * in_features * 13 // 16 or not weight.is_contiguous():
            raise ValueError("int6 pack: the weight bytes do not fit the rows")
        if tiled.numel() != out_features * (in_features // 256) or not tiled.is_contiguous():
            raise ValueError("int6 pack: the scales do not fit the rows")
        inputs = (q.data_ptr(), sub_scales.data_ptr(), scales.data_ptr())
        self._pack(*inputs, out_features, in_features, weight.data_ptr(), tiled.data_ptr())
        return weight, tiled


class NativeInt6Logits(NativeInt6Matmul):
    """NativeInt6Matmul with fp32 output: the output projection."""

    symbol, out_dtype = "int6_logits", torch.float32


def int6_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """weight [rows, in] fp32 (in % 256 == 0) on Q6_K's grid (int6_grid.c): q [rows, in]
    uint8, c [rows, in / 16] int8, d [rows, in / 256] fp32, and how many super-blocks of
    256 were on no such grid and were rounded."""
    weight = weight.contiguous()
    rows, in_features = weight.shape
    q = torch.empty(rows, in_features, dtype=torch.uint8)
    c = torch.empty(rows, in_features // 16, dtype=torch.int8)
    d = torch.empty(rows, in_features // 256, dtype=torch.float32)
    pointers = (q.data_ptr(), c.data_ptr(), d.data_ptr())
    rounded = _int6_grid()(weight.data_ptr(), rows, in_features, *pointers)
    return q, c, d, rounded


@cache
def _int6_grid() -> ctypes._CFuncPtr:
    function = load_library().int6_grid
    function.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR]
    function.restype = _I64
    return function


class NativeInt8Matmul(_TiledMatmul):
    """Weight-only int8 matmul in C (int8_matmul.c), in groups of 32 with fp16 scales and
    fp32 output: the output projection."""

    symbol, out_dtype = "int8_matmul", torch.float32

    @staticmethod
    def pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] int8, contiguous, reordered in place; scales [out, in / 32] fp16.
        Returns the kernel's weight bytes (q's storage) and scales, in the tile order
        int8_matmul.c describes."""
        out_features, in_features = q.shape
        tiles, groups = out_features // 16, in_features // 32
        # Each tile of 16 rows lands on its own rows' bytes, so `q` is reordered in place, a
        # few tiles at a time: a vocabulary's weight is not held twice.
        tiled = q.reshape(tiles, 16, groups, 16, 2)
        for first in range(0, tiles, 64):
            part = tiled[first : first + 64]
            part.copy_(part.permute(0, 2, 3, 1, 4).contiguous().view(part.shape))
        tiled_scales = scales.to(torch.float16).reshape(tiles, 16, groups).permute(0, 2, 1)
        return q.reshape(-1), tiled_scales.contiguous().reshape(-1)

    @staticmethod
    def rows(
        weight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, in_features: int
    ) -> torch.Tensor:
        """Rows `ids` of the packed weight, dequantised to fp32 [len(ids), in]: a tied
        embedding's lookup."""
        groups = in_features // 32
        tiles, column = ids // 16, ids % 16
        q = weight.view(-1, groups, 16, 16, 2)[tiles, :, :, column, :]  # [n, groups, 16, 2]
        scale = scales.view(-1, groups, 16)[tiles, :, column].float()  # [n, groups]
        values = q.reshape(-1, groups, 32).float() * scale[..., None]
        return values.reshape(-1, in_features)


class NativeArgmax:
    """torch.argmax over the last dimension of fp32 CPU rows, in C (argmax.c). Raises
    NativeUnavailable where the library cannot be built."""

    def __init__(self) -> None:
        self.kernel = load_library().argmax_rows
        self.kernel.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self.kernel.restype = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [rows, vocab]. None where the kernel does not apply (another dtype,
        device or layout): the caller then takes torch.argmax."""
        if (
            logits.dim() != 2
            or logits.dtype != torch.float32
            or logits.device.type != "cpu"
            or logits.stride(1) != 1
            or logits.shape[0] == 0
            or logits.shape[1] == 0
        ):
            return None
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        rows, vocab = logits.shape
        self.kernel(logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr())
        return out
