"""int4 linear layers (groups of 32 along the input, a scale and a zero each), on our C
kernel with bf16 activations (model/native/int4_matmul.c) or int8 ones
(int4_matmul_a8.c), or on PyTorch's (`_weight_int4pack_mm_for_cpu`): which one is the
kernel plan's choice per layer shape (model/plan/int4_kernel.py), handed to the layer
when it is built.

A GGUF Q4_0, Q4_1 or Q4_K group (w = step q + low, q in 0..15) is int4 as it is: the scale
is the step and the zero low + 8 step, read from the file's blocks
(model/checkpoint/file_blocks.py) or found again in their values (model/quant/file_grid.py).
A layer whose every row came from Q4_K blocks keeps them exactly, on the C kernels, in the
superblock layout of its scales (model/native/int4k.py): 4.625 bits a weight, not 5, where
that build's loops gain from it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as T

from model.checkpoint.dequant import q4_grid, q4_k_superblocks
from model.checkpoint.file_blocks import FileBlocks
from model.errors import UnsupportedFormatError
from model.native.int4k import SUPERBLOCK, int4_matmul_for, superblock_scales, superblocks_pay
from model.native.ops import NativeInt4Matmul
from model.quant.base import INT4_GROUP, QuantizedLinear
from model.quant.file_grid import file_grid

NATIVE_INT4_KERNELS = ("native", "native_a8")
INT4_KERNELS = (*NATIVE_INT4_KERNELS, "torch")
BF16_ACTIVATION_KERNELS = ("native", "torch")
W4A8_KERNELS = ("native_a8",)


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 in groups of 32 input columns: w = (q - 8) * scale + zero.

    kernel: "native" (C, its own tiled layout, bf16 activations), "native_a8" (the same
    layout, activations rounded to int8 in groups of 32) or "torch" (PyTorch's packed
    layout), as the kernel plan chose it for this shape among `allowed` (by default the
    weight-only ones, with bf16 activations); None: PyTorch's where `allowed` has it, the
    reference every kernel is tested against, else the first allowed."""

    staging_dtype = torch.uint8
    block_types = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        kernel: str | None = None,
        allowed: tuple[str, ...] = BF16_ACTIVATION_KERNELS,
    ) -> None:
        if in_features % INT4_GROUP or out_features % 16:
            raise UnsupportedFormatError(
                f"int4 needs in_features divisible by {INT4_GROUP} and out_features by 16, "
                f"got [{out_features}, {in_features}]"
            )
        if kernel is not None and kernel not in INT4_KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r}; expected one of {INT4_KERNELS}")
        super().__init__(in_features, out_features, device)
        if kernel is None:
            kernel = "torch" if "torch" in allowed else allowed[0]
        self.kernel, self.allowed = kernel, allowed
        self._native: Callable[..., torch.Tensor] | None = None
        # Q4_K's own fields of the rows that came from Q4_K blocks: d, dmin, sc, m.
        self._superblocks: tuple[torch.Tensor, ...] | None = None
        self._superblock_rows = 0
        self.superblocks = False  # whether the scales are in the superblock layout
        groups = in_features // INT4_GROUP
        self.register_buffer(
            "scales_and_zeros",
            torch.empty(groups, out_features, 2, dtype=torch.bfloat16, device=device),
        )
        self.register_buffer("weight_int4", torch.empty(0, dtype=torch.uint8, device=device))

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        rows = weight.shape[0]
        groups = weight.reshape(rows, -1, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15.0).clamp(min=1e-12)
        scale = torch.where(*file_grid(groups, low), scale)
        q = ((groups - low) / scale).round().clamp(0, 15)
        self._stage_grid(row, q.to(torch.uint8), scale, low)

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        blocks = weight.blocks()
        q, step, low = q4_grid(blocks, weight.qtype)
        rows = weight.shape[0]
        self._stage_grid(row, q, step.reshape(rows, -1, 1), low.reshape(rows, -1, 1))
        if weight.qtype == T.Q4_K and self.kernel in NATIVE_INT4_KERNELS and superblocks_pay():
            self._stage_superblocks(row, rows, q4_k_superblocks(blocks))

    def _stage_superblocks(self, row: int, rows: int, fields: tuple[torch.Tensor, ...]) -> None:
        if self._superblocks is None:
            supers, groups = self.in_features // SUPERBLOCK, self.in_features // INT4_GROUP
            self._superblocks = (
                torch.empty(self.out_features, supers, dtype=torch.float16),
                torch.empty(self.out_features, supers, dtype=torch.float16),
                torch.empty(self.out_features, groups, dtype=torch.uint8),
                torch.empty(self.out_features, groups, dtype=torch.uint8),
            )
        for staged, field in zip(self._superblocks, fields, strict=True):
            staged[row : row + rows] = field.reshape(rows, -1)
        self._superblock_rows += rows

    def _stage_grid(
        self, row: int, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
    ) -> None:
        """w = scale q + low: q in 0..15, scale and low [rows, groups, 1] in float32."""
        rows = scale.shape[0]
        self._staging[row : row + rows] = q.reshape(rows, -1)
        zero = low + 8.0 * scale
        pairs = torch.cat([scale, zero], dim=-1).transpose(0, 1)  # [groups, rows, 2]
        self.scales_and_zeros[:, row : row + rows] = pairs.to(torch.bfloat16)

    def _pack(self) -> None:
        if self.kernel in NATIVE_INT4_KERNELS:
            self.superblocks = self._superblock_rows == self.out_features
            self._native = int4_matmul_for(self.kernel, self.superblocks)
            # Replaced, not kept beside: the weight exists once, in the kernel's layout.
            self.weight_int4, self.scales_and_zeros = NativeInt4Matmul.pack(
                self._staging, self.scales_and_zeros
            )
            if self.superblocks:
                self.scales_and_zeros = superblock_scales(*self._superblocks)
            self._superblocks = None
        else:
            q = self._staging.to(torch.int32)
            self.weight_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)

    def use_kernel(self, kernel: str) -> None:
        """Switches between our C kernels, which read the same bytes: bf16 or int8
        activations (the activation probe's choice, model/plan/activation_probe.py)."""
        if kernel not in NATIVE_INT4_KERNELS or self.kernel not in NATIVE_INT4_KERNELS:
            raise ValueError(f"int4 kernel {self.kernel!r} cannot become {kernel!r}")
        self.kernel = kernel
        if self._native is not None:
            self._native = int4_matmul_for(kernel, self.superblocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self._native is not None:
            out = self._native(flat, self.weight_int4, self.scales_and_zeros, self.out_features)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.weight_int4, INT4_GROUP, self.scales_and_zeros
            )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        layout = ", superblocks" if self.superblocks else ""
        return f"{super().extra_repr()}, kernel={self.kernel}{layout}"
