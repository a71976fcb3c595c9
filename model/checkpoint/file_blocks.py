"""Rows of a GGUF matrix still in the file's quantisation blocks, handed to a quantised
layer that holds their block type as it is: int4 a Q4_0, Q4_1 or Q4_K block (a scale and a
minimum per group of 32), int5 a Q5_0 one, int6 a Q6_K one, grouped int8 a Q8_0 one,
MXFP4's layer an MXFP4 one (as it stores them). Such a layer reads the integers and scales
from the bytes (`model/checkpoint/dequant.py`'s grids) instead of finding them again in
dequantised floats: searching float32 copies for the grids the file states was about half
of the 21-22 s Qwen2.5-Coder-1.5B's Q4_K_M took to load. Any other destination
dequantises them (`dequantize`), as the loader did before."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from model.checkpoint.dequant import dequantize

T = GGMLQuantizationType
# The block types some quantised layer holds as they are.
LAYER_BLOCK_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.MXFP4})
# The block types a layer holds as they are whatever the model's format (MXFP4: gpt-oss's
# experts, model/quant/mxfp4.py), never expanded to floats.
HELD_BLOCK_TYPES = frozenset({T.MXFP4})


@dataclass(frozen=True)
class FileBlocks:
    """raw: uint8 [rows, bytes a row]; width: weights a row; dtype: what `dequantize` gives;
    stack: how many matrices of equal rows `raw` holds one after another (a layer's
    experts, as an HF checkpoint stacks them), each taken by `matrix`."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    width: int
    dtype: torch.dtype
    stack: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.width

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def rows(self, start: int, end: int) -> FileBlocks:
        return replace(self, raw=self.raw[start:end], stack=1)

    def matrix(self, index: int) -> FileBlocks:
        """The stack's matrix `index`, on its own."""
        rows = self.raw.shape[0] // self.stack
        return replace(self, raw=self.raw[index * rows : (index + 1) * rows], stack=1)

    def blocks(self) -> torch.Tensor:
        """The rows' blocks, [rows * blocks a row, bytes a block], in the file's order."""
        return self.raw.reshape(-1, GGML_QUANT_SIZES[self.qtype][1])

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape, self.dtype)
