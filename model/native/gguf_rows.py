"""Python entry point of gguf_rows.c: rows of a GGUF embedding table dequantised from its
blocks in one C call, for the block types it decodes (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)."""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType

from model.native.build import NativeUnavailable, load_library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_Q = GGMLQuantizationType
TYPES = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q8_0, _Q.Q4_K, _Q.Q6_K})


class GgufRows:
    """The C lookup of one table's rows: `table` [rows, row_bytes] uint8, contiguous."""

    def __init__(self, table: torch.Tensor, qtype: GGMLQuantizationType, dim: int) -> None:
        self._kernel = load_library().gguf_rows
        self._kernel.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]
        self._kernel.restype = ctypes.c_int
        self.table, self.qtype, self.dim = table, qtype, dim
        self._head = (table.data_ptr(), table.shape[0], table.shape[1], dim, int(qtype))

    @classmethod
    def for_table(
        cls, table: torch.Tensor, qtype: GGMLQuantizationType, dim: int, dtype: torch.dtype
    ) -> GgufRows | None:
        """The C lookup where it decodes `qtype` into `dtype`; None where it does not, or
        where the library cannot be built (the caller then decodes in PyTorch)."""
        if qtype not in TYPES or dtype not in (torch.float32, torch.bfloat16):
            return None
        try:
            return cls(table, qtype, dim)
        except NativeUnavailable:
            return None

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [n], on the CPU) in `dtype`, [n, dim]."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.dim, dtype=dtype)
        bf16 = dtype == torch.bfloat16
        status = self._kernel(*self._head, ids.data_ptr(), ids.shape[0], out.data_ptr(), bf16)
        if status == 2:
            raise IndexError(
                f"token id out of range for an embedding of {self.table.shape[0]} rows"
            )
        if status:
            raise ValueError(f"gguf_rows cannot decode {self.qtype.name}")
        return out
