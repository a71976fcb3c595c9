"""Python entry points of the native kernels that are not an attention backend."""

from __future__ import annotations

import ctypes

import torch

from model.native.build import load_library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


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
