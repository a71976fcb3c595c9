"""An embedding table kept as the GGUF file stores it, in its quantisation blocks, and
dequantised a row at a time as tokens are looked up.

A vocabulary of 152k rows is most of a small model: Qwen2.5-0.5B's embedding held 259 MB in
bf16, more than all its decoder layers in int8, while a step reads only its tokens' rows.
Here the table is the file's own bytes, memory-mapped as llama.cpp maps them: only the
pages of rows ever looked up become resident, and a row comes out exactly as dequantising
the whole table would have given it (model/checkpoint/dequant.py; the common block types' rows
in one C call, model/native/gguf_rows.c). The file must not change
while the model runs.

The table's pages are asked into the page cache at load (MADV_WILLNEED, read ahead in the
background), not when a token first needs its row: a row read from disk in the middle of a
decode step held that step, and every stream in it, for 50-670 ms (one stream on a
Qwen3-30B-A3B-shape GGUF, inter-token p50 20 ms). The pages count in the page cache, not in
the process's resident memory, until a row is looked up.
"""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from model.checkpoint.dequant import dequantize
from model.native.gguf_rows import GgufRows


def read_ahead(buffer: mmap.mmap, offset: int, length: int) -> bool:
    """Asks the kernel to read `length` bytes from `offset` of a file's mapping into the
    page cache now; False where the platform has no madvise or the kernel refused the
    advice (nothing else changes)."""
    if not hasattr(mmap, "MADV_WILLNEED") or length <= 0:
        return False
    start = offset - offset % mmap.PAGESIZE
    try:
        buffer.madvise(mmap.MADV_WILLNEED, start, min(offset + length, len(buffer)) - start)
    except OSError:  # advice only: rows are then read as they are first looked up
        return False
    return True


class PackedEmbedding(nn.Module):
    def __init__(
        self,
        path: Path,
        offset: int,
        rows: int,
        dim: int,
        qtype: GGMLQuantizationType,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.dim, self.qtype, self.dtype = dim, qtype, dtype
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dim // block * type_size
        with warnings.catch_warnings():  # read-only: rows are only ever gathered (copied)
            warnings.simplefilter("ignore", UserWarning)
            table = torch.frombuffer(
                self._map, dtype=torch.uint8, count=rows * row_bytes, offset=offset
            )
        self.table = table.view(rows, row_bytes)
        read_ahead(self._map, offset, rows * row_bytes)
        # A step's few rows in one C call where it decodes the type: PyTorch's whole-tensor
        # decoders cost ~150 us of small ops for a one-token step.
        self._native = GgufRows.for_table(self.table, qtype, dim, dtype)

    @property
    def num_embeddings(self) -> int:
        return self.table.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        if self._native is not None:
            values = self._native(flat, self.dtype)
        else:
            rows = self.table[flat]
            values = dequantize(rows.reshape(-1), self.qtype, (len(flat), self.dim), self.dtype)
        return values.to(ids.device).reshape(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, {self.qtype.name}, memory-mapped"
