"""MXFP4 linear layers: the weight held in GGUF's MXFP4 blocks as the checkpoint stores them
(model/checkpoint/mxfp4.py; 17 bytes per 32 weights, 4.25 bits a weight), never expanded
to floats, multiplied by the C kernel on the CPU (model/native/mxfp4_matmul.c), the Triton
one on CUDA (model/quant/mxfp4_triton.py) or, as the reference, by PyTorch on the
dequantised weight. The activations keep their dtype: fp32 rows give fp32 products.

gpt-oss stores its experts so, and any GGUF matrix of type MXFP4 loads here: its blocks
are copied in as they are; float rows (a tensor-parallel slice of them, dequantised) are
quantised as the gguf package does, which gives MXFP4 values back their own blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.mxfp4 import BLOCK, BLOCK_BYTES, dequantize_rows, quantize_rows
from model.errors import UnsupportedFormatError
from model.native.build import NativeUnavailable
from model.native.huge_pages import empty_on_huge_pages
from model.native.mxfp4 import NativeMxfp4Matmul
from model.quant.base import QuantizedLinear

MXFP4_KERNELS = ("native", "native_a8", "torch")
NATIVE_MXFP4_KERNELS = ("native", "native_a8")


class Mxfp4Linear(QuantizedLinear):
    """kernel: "native" (the C kernel on the CPU, where the library builds), "native_a8"
    (the same weight bytes, activations rounded to int8 per block of 32 as llama.cpp's
    Q8_0) or "torch" (the dequantised weight, the reference); on CUDA, Triton's."""

    staging_dtype = torch.uint8
    block_types = frozenset({T.MXFP4})

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        kernel: str | None = None,
    ) -> None:
        if in_features % BLOCK:
            raise UnsupportedFormatError(
                f"MXFP4 needs in_features divisible by {BLOCK}, got [{out_features}, {in_features}]"
            )
        if kernel is not None and kernel not in MXFP4_KERNELS:
            raise ValueError(f"unknown MXFP4 kernel {kernel!r}; expected one of {MXFP4_KERNELS}")
        super().__init__(in_features, out_features, device)
        self.kernel = kernel or "native"
        self._native: NativeMxfp4Matmul | None = None
        row_bytes = in_features // BLOCK * BLOCK_BYTES
        # On 2 MB pages: a decode streams each chosen expert's bytes once
        # (model/native/huge_pages.py).
        weight = empty_on_huge_pages((out_features, row_bytes), torch.uint8, device)
        self.register_buffer("weight_mxfp4", weight)

    def _new_staging(self) -> torch.Tensor:
        return self.weight_mxfp4  # the blocks land where they stay: nothing is repacked

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        self._staging[row : row + weight.shape[0]] = quantize_rows(weight)

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        self._staging[row : row + weight.shape[0]] = weight.raw.to(self.device)

    def _pack(self) -> None:
        self.weight_mxfp4 = self._staging
        self._native = None
        if self.kernel in NATIVE_MXFP4_KERNELS and self.device.type == "cpu":
            try:
                self._native = NativeMxfp4Matmul(int8_activations=self.kernel == "native_a8")
            except NativeUnavailable:
                self.kernel = "torch"

    @property
    def on_c_kernel(self) -> bool:
        """Whether the products run on the C kernel (the C layer's and experts' calls may
        then take the weight)."""
        return self._native is not None

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in]: the reference's, and a test's."""
        return dequantize_rows(self.weight_mxfp4, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cuda":
            from model.quant.mxfp4_triton import mxfp4_matmul  # triton: only where CUDA is

            out = mxfp4_matmul(flat, self.weight_mxfp4, self.out_features)
        elif self._native is not None and flat.dtype in self._native.kernels:
            out = self._native(flat, self.weight_mxfp4, self.out_features)
        else:
            out = F.linear(flat, self.dequantized().to(flat.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel}"
