"""One fused linear layer held in two formats: its first rows in one, the rest in another.

A Q4_K_M file stores some layers' Q and K in Q4_K (or Q5_0) and their V in Q6_K (or Q8_0).
Fused into one Q/K/V layer, grouped int8 was the narrowest single format that held all
three: 8.5 bits a weight where int4 holds Q4_K's Q and K exactly in 4.625 (int5 Q5_0's in
5.5) and int6 V in 6.625. On
Qwen2.5-Coder-1.5B those 14 layers read 46.8 MB a decode step in grouped int8 and 26.8 MB
split, Q and K on the int4 kernel and V on its own. The C decoder layer runs both products
in one call (model/native/decoder_layer.c, `SPLIT`).
"""

from __future__ import annotations

import torch

from model.checkpoint.file_blocks import FileBlocks
from model.quant.base import QuantizedLinear

SPLIT = "+"  # between a split layer's two quantizations in the kernel plan
PARTS = ("first", "second")  # its parts' attribute names


def split_name(first: str, second: str) -> str:
    """A split layer's quantization: its first rows' and its last rows' ('int4+int6')."""
    return f"{first}{SPLIT}{second}"


def split_parts(quantization: str | None) -> tuple[str, str] | None:
    """A split layer's two quantizations, or None for any other (and for float layers)."""
    if quantization is None:
        return None
    first, sep, second = quantization.partition(SPLIT)
    return (first, second) if sep else None


class SplitLinear(QuantizedLinear):
    """Rows [0, first.out_features) in `first`, the rest in `second`; both over the same
    input. The checkpoint's rows go to whichever part holds them."""

    def __init__(self, first: QuantizedLinear, second: QuantizedLinear) -> None:
        if first.in_features != second.in_features:
            raise ValueError("the two parts of a split layer take the same input")
        super().__init__(first.in_features, first.out_features + second.out_features, "meta")
        self.first, self.second = first, second

    @property
    def ready(self) -> bool:
        return self.first.ready and self.second.ready

    @property
    def first_rows(self) -> int:
        return self.first.out_features

    def load_rows(self, row: int, weight: torch.Tensor | FileBlocks) -> None:
        rows = weight.shape[0]
        if weight.shape[1] != self.in_features or not 0 <= row <= self.out_features - rows:
            raise ValueError(
                f"rows {row}..{row + rows} of width {weight.shape[1]} do not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        cut = min(max(self.first_rows - row, 0), rows)  # how many go to the first part
        if cut:
            self.first.load_rows(row, _rows(weight, 0, cut))
        if cut < rows:
            self.second.load_rows(row + cut - self.first_rows, _rows(weight, cut, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.first(x), self.second(x)], dim=-1)


def _rows(weight: torch.Tensor | FileBlocks, start: int, end: int) -> torch.Tensor | FileBlocks:
    if isinstance(weight, FileBlocks):
        return weight.rows(start, end)
    return weight[start:end]
