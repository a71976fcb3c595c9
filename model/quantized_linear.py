"""Weight-only quantised linear layers for the CPU: int8 (one scale per output row) and
int4 (groups of 32 along the input, a scale and a zero each). int8 runs on PyTorch's
packed kernel (`_weight_int8pack_mm`) with bf16 activations; int4 on ours in C, with bf16
activations (model/native/int4_matmul.c) or int8 ones (int4_matmul_a8.c), or on PyTorch's
(`_weight_int4pack_mm_for_cpu`), whichever is fastest for the layer's shape on this
machine (model/int4_kernel.py).

Weights arrive in rows (a fused QKV weight as its Q, K and V parts) and are quantised as
they come, from the checkpoint's own values, so no full-precision copy of the model is
ever held: a module keeps only its small integer staging buffer until its last rows are in,
then packs. A GGUF Q4_0, Q4_1 or Q4_K group (w = step q + low, q in 0..15) is int4 as it
is: the scale is the step and the zero low + 8 step, read from the file's blocks
(model/checkpoint/file_blocks.py) or found again in their values (model/file_grid.py).
Nothing here knows the network.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from model import cpu_kernels
from model.checkpoint.dequant import q4_grid
from model.checkpoint.file_blocks import FileBlocks
from model.errors import UnsupportedFormatError
from model.file_grid import file_grid
from model.int4_kernel import BF16_ACTIVATION_KERNELS, INT4_KERNELS, NATIVE_INT4_KERNELS
from model.native.ops import NativeInt4Matmul, native_int4_matmul

INT4_GROUP = 32
FP16_SMALLEST = 2.0**-24  # the smallest positive float16
FP16_LARGEST = 65504.0
STAGE_ROWS = 256
STAGE_BLOCK_ROWS = 2048
QUANTIZATIONS = ("int8", "int8g", "int4", "w4a8")
# Formats the loader gives single layers, never a whole model (no flag asks for them).
LAYER_ONLY_QUANTIZATIONS = ("int5", "w5a8", "int6")


def fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    """Group scales in float16, as the symmetric kernels read them: GGUF's own scale type,
    so a Q8_0 or Q5_0 block keeps its scale exactly, in half a bit a weight where float32
    took one. Never rounded to zero: a scale below float16's range keeps its sign at the
    smallest magnitude."""
    half = scales.clamp(-FP16_LARGEST, FP16_LARGEST).to(torch.float16)
    smallest = torch.full_like(half, FP16_SMALLEST)
    return torch.where(half == 0, torch.where(scales < 0, -smallest, smallest), half)


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight is filled by `load_rows`, then packed."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._rows_loaded = 0
        self._staging: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def ready(self) -> bool:
        return self._rows_loaded == self.out_features

    def load_rows(self, row: int, weight: torch.Tensor | FileBlocks) -> None:
        """weight: [rows, in_features], any float dtype, or a GGUF file's blocks of them;
        rows may come in any order."""
        if isinstance(weight, FileBlocks) and weight.qtype not in self.block_types:
            weight = weight.dequantize()
        rows = weight.shape[0]
        if weight.shape[1] != self.in_features or not 0 <= row <= self.out_features - rows:
            raise ValueError(
                f"rows {row}..{row + rows} of width {weight.shape[1]} do not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        if self._staging is None:
            self._staging = self._new_staging()
        # In slices: quantising takes a few float temporaries the size of what it is given,
        # and a whole vocabulary's output weight (113 MB in fp32 for the default model) made
        # them the server's peak memory.
        blocks = isinstance(weight, FileBlocks)
        # File blocks unpack into a few small temporaries: they come in larger slices.
        for start in range(0, rows, STAGE_BLOCK_ROWS if blocks else STAGE_ROWS):
            if blocks:
                self._stage_blocks(row + start, weight.rows(start, start + STAGE_BLOCK_ROWS))
            else:
                part = weight[start : start + STAGE_ROWS].to(self.device, torch.float32)
                self._stage(row + start, part)
        self._rows_loaded += rows
        if self.ready:
            self._pack()
            self._staging = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    staging_dtype: torch.dtype  # the integer type `_stage` writes
    scale_dtype = torch.bfloat16  # what the kernel reads its scales in, whatever the model's
    # GGUF block types the format holds as they are, staged by `_stage_blocks`.
    block_types: frozenset[T] = frozenset()

    def _new_staging(self) -> torch.Tensor:
        return torch.empty(
            self.out_features, self.in_features, dtype=self.staging_dtype, device=self.device
        )

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        raise NotImplementedError

    def _pack(self) -> None:
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """Symmetric int8, one scale per output row."""

    staging_dtype = torch.int8

    def __init__(self, in_features: int, out_features: int, device: torch.device | str) -> None:
        super().__init__(in_features, out_features, device)
        self.register_buffer(
            "scales", torch.empty(out_features, dtype=torch.bfloat16, device=device)
        )
        self.register_buffer("weight_int8", torch.empty(0, dtype=torch.int8, device=device))

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = (weight / scale[:, None]).round().clamp(-127, 127)
        self._staging[row : row + weight.shape[0]] = q.to(torch.int8)
        self.scales[row : row + weight.shape[0]] = scale.to(torch.bfloat16)

    def _pack(self) -> None:
        self.weight_int8 = self._staging

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 in groups of 32 input columns: w = (q - 8) * scale + zero.

    kernel: "native" (C, its own tiled layout, bf16 activations), "native_a8" (the same
    layout, activations rounded to int8 in groups of 32), "torch" (PyTorch's packed
    layout), or None to take the fastest of `allowed` (by default the weight-only ones, with
    bf16 activations) for this shape, timed once per process."""

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
        self.kernel, self.allowed = kernel, allowed
        self._native: Callable[..., torch.Tensor] | None = None
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
        q, step, low = q4_grid(weight.blocks(), weight.qtype)
        rows = weight.shape[0]
        self._stage_grid(row, q, step.reshape(rows, -1, 1), low.reshape(rows, -1, 1))

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
        if self.kernel is None:
            self.kernel = cpu_kernels.int4_kernel(
                self.in_features, self.out_features, self.device, self.allowed
            )
        if self.kernel in NATIVE_INT4_KERNELS:
            self._native = native_int4_matmul(self.kernel)
            # Replaced, not kept beside: the weight exists once, in the kernel's layout.
            self.weight_int4, self.scales_and_zeros = NativeInt4Matmul.pack(
                self._staging, self.scales_and_zeros
            )
        else:
            q = self._staging.to(torch.int32)
            self.weight_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)

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
        return f"{super().extra_repr()}, kernel={self.kernel}"


def quantized_linear(
    quantization: str, in_features: int, out_features: int, device: torch.device | str
) -> QuantizedLinear:
    """int4 is weight-only: the products take the activations in bf16. w4a8 is int4 on the
    kernel that rounds them to int8 first (llama.cpp's arithmetic for a Q4 GGUF), faster
    where the CPU has AVX-512 VNNI and less exact. int5 and int6 (GGUF Q5_0's and Q6_K's own
    formats) are no choice of the flags: the loader takes them for Q5_0 and Q6_K layers
    (LAYER_ONLY_QUANTIZATIONS), and w5a8 (int5 with int8 activations) for Q5_0 layers of a
    model in w4a8."""
    if quantization == "int8":
        return Int8Linear(in_features, out_features, device)
    # The other formats' modules build on this one's QuantizedLinear: imported here.
    if quantization == "int8g":
        from model.int8_group_linear import Int8GroupLinear

        return Int8GroupLinear(in_features, out_features, device, fp32_output=False)
    if quantization in ("int5", "w5a8"):
        from model.int5_linear import Int5Linear

        return Int5Linear(in_features, out_features, device, quantization == "w5a8")
    if quantization == "int6":
        from model.int6_linear import Int6Linear

        return Int6Linear(in_features, out_features, device)
    if quantization == "int4":
        return Int4Linear(in_features, out_features, device, allowed=BF16_ACTIVATION_KERNELS)
    if quantization == "w4a8":
        return Int4Linear(in_features, out_features, device, allowed=("native_a8",))
    raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")
