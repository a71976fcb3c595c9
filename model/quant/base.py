"""The base of every weight-only quantised linear layer (model/quant/): a bias-free layer
whose weight arrives in rows (a fused QKV weight as its Q, K and V parts) and is quantised
as it comes, from the checkpoint's own values, so no full-precision copy of the model is
ever held: a module keeps only its small integer staging buffer until its last rows are in,
then packs. Nothing here knows the network, and no layer chooses its own kernel: the
kernel plan (model/plan/) hands it over when the layer is built.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from model.checkpoint.file_blocks import FileBlocks
from model.native.huge_pages import empty_on_huge_pages

INT4_GROUP = 32
FP16_SMALLEST = 2.0**-24  # the smallest positive float16
FP16_LARGEST = 65504.0
STAGE_ROWS = 256
STAGE_BLOCK_ROWS = 2048
QUANTIZATIONS = ("int8", "int8g", "int4", "w4a8")
# Formats the loader gives single layers, never a whole model (no flag asks for them).
LAYER_ONLY_QUANTIZATIONS = ("int5", "w5a8", "int6", "w6a8", "w8a8", "mxfp4")


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
        # Where packing keeps these bytes (grouped int8 reorders them in place), a decode
        # streams them from 2 MB pages (model/native/huge_pages.py).
        shape = (self.out_features, self.in_features)
        return empty_on_huge_pages(shape, self.staging_dtype, self.device)

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        raise NotImplementedError

    def _pack(self) -> None:
        raise NotImplementedError
