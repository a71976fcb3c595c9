"""5-bit linear layers for the CPU: GGUF's Q5_0 (w = d * (q - 16), q in 0..31, an fp16
scale per group of 32) held exactly in 5.5 bits a weight, on the C kernel
(model/native/int5_matmul.c).

Small models' Q4_K_M files keep most of their layers in Q5_0 (the K-quants need rows of
256: Qwen2.5-0.5B's 896 and Gemma 3 270M's 640 are not), which grouped int8 also holds
exactly but in 8.5 bits: Qwen2.5-Coder-0.5B's layers take 0.27 GB as grouped int8 and
0.17 GB here, and a step reads that much less.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from model.checkpoint.dequant import q5_0_grid
from model.checkpoint.file_blocks import FileBlocks
from model.errors import UnsupportedFormatError
from model.native.ops import NativeInt5A8Matmul, NativeInt5Matmul
from model.quant.base import INT4_GROUP, QuantizedLinear, fp16_scales
from model.quant.file_grid import sorted_groups

LEVELS = 16  # q - 16 spans -16..15
ON_GRID = 1e-3  # how far from an integer a weight over its step may lie to count as on it


class Int5Linear(QuantizedLinear):
    """Symmetric 5-bit in groups of 32 input columns, fp16 scales, on the C kernel; bf16
    output. A group already on a grid of at most 32 steps around zero (a Q5_0 block) keeps
    that step, so it loads without loss; any other group is rounded to 31 steps of its
    largest magnitude. `int8_activations` rounds each row of x to int8 in groups of 32
    first (int5_matmul_a8.c: llama.cpp's arithmetic for a Q5_0 layer), which AVX-512 VNNI
    multiplies at twice the rate of bf16, at the cost of that rounding."""

    staging_dtype = torch.uint8
    scale_dtype = torch.float16
    block_types = frozenset({GGMLQuantizationType.Q5_0})

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        int8_activations: bool = False,
    ) -> None:
        if in_features % INT4_GROUP or out_features % 16:
            raise UnsupportedFormatError(
                f"5-bit groups need in_features divisible by {INT4_GROUP} and out_features "
                f"by 16, got [{out_features}, {in_features}]"
            )
        super().__init__(in_features, out_features, device)
        self.int8_activations = int8_activations
        self._native: NativeInt5Matmul | NativeInt5A8Matmul | None = None
        groups = in_features // INT4_GROUP
        self.register_buffer(
            "scales", torch.empty(out_features, groups, dtype=torch.float16, device=device)
        )
        self.register_buffer("weight_int5", torch.empty(0, dtype=torch.uint8, device=device))

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        rows = weight.shape[0]
        groups = weight.reshape(rows, -1, INT4_GROUP)
        step = fp16_scales(_grid_step(groups))
        q = (groups / step.float()).round().clamp(-LEVELS, LEVELS - 1) + LEVELS
        self._staging[row : row + rows] = q.reshape(rows, -1).to(torch.uint8)
        self.scales[row : row + rows] = step.squeeze(-1)

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        q, d = q5_0_grid(weight.blocks())
        rows = weight.shape[0]
        self._staging[row : row + rows] = q.reshape(rows, -1)
        self.scales[row : row + rows] = d.reshape(rows, -1)

    def _pack(self) -> None:
        packer = NativeInt5Matmul()
        self.weight_int5, self.scales = packer.pack(self._staging, self.scales)
        self._native = NativeInt5A8Matmul() if self.int8_activations else packer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self._native(flat, self.weight_int5, self.scales, self.out_features)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def _grid_step(groups: torch.Tensor) -> torch.Tensor:
    """Per group of 32 [..., 32], a step its values are integer multiples of within
    -16..15, negative where that needs it: a Q5_0 block's d, which llama.cpp's quantiser
    takes as the largest-magnitude value over -16 (so that value is -16 d, of either
    sign); where another quantiser left it inside, the smallest gap between values, of
    either sign; for a group on no such grid, its largest magnitude over 15."""
    high, low = groups.amax(dim=-1, keepdim=True), groups.amin(dim=-1, keepdim=True)
    largest = torch.maximum(high, -low)
    extreme = torch.where(high >= -low, high, low)
    step = torch.where(extreme == 0, 1.0, extreme / -LEVELS)
    found = _on_grid(groups, step).squeeze(-1)
    if not bool(found.all()):
        # Sorted only where needed: most of a Q5_0 tensor's groups are found above.
        rest, rest_largest = groups[~found], largest[~found]
        ordered = sorted_groups(rest)
        gaps = ordered[..., 1:] - ordered[..., :-1]
        gap = gaps.masked_fill(gaps <= rest_largest * 1e-4, float("inf")).amin(-1, keepdim=True)
        gap = torch.where(gap.isfinite(), gap, 1.0)
        fallback = torch.where(_on_grid(rest, -gap), -gap, rest_largest.clamp(min=1e-30) / 15)
        step[~found] = torch.where(_on_grid(rest, gap), gap, fallback)
    return step


def _on_grid(groups: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    steps = groups / step
    rounded = steps.round()
    inside = (rounded.amin(dim=-1, keepdim=True) >= -LEVELS) & (
        rounded.amax(dim=-1, keepdim=True) <= LEVELS - 1
    )
    return inside & (steps.sub_(rounded).abs_().amax(dim=-1, keepdim=True) < ON_GRID)
