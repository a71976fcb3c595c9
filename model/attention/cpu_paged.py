"""Decode attention on the CPU in a C kernel that reads K and V in place.

The reference gathers each decoding sequence's padded context into a new tensor, casts it
to fp32 and runs two batched products per KV head: several passes over the whole context,
per layer and per step, so a step's host work grows with context length (at 8 sequences
of 400 tokens it was half the step). The C kernel (model/native/paged_decode.c) walks each
sequence's block table once, in fp32; on a 2-core AVX-512 machine it reads K/V at close
to memory bandwidth, and decode steps of 16 sequences of 550 tokens went from 184 to 76 ms.

Prefill chunks keep the reference's SDPA path: they are long enough that the gather is a
small share of their work. A sequence's result does not depend on the rest of its batch
(the kernel handles each one alone), so batch invariance holds as with the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from model.attention.torch_ref import TorchRefBackend, TorchRefPlan, _Group
from model.batch import Batch
from model.native.build import load_library
from model.native.layer import DecodeBatch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]


@dataclass
class CpuPagedPlan(TorchRefPlan):
    decode_lens: torch.Tensor | None = None  # [decodes] int64: the decode group's lengths
    # A step of decodes only, for decoder layers that run whole in C (model/native/layer.py).
    decodes: DecodeBatch | None = None


class CpuPagedBackend(TorchRefBackend):
    """Raises NativeUnavailable (model/native/build.py) where the kernel cannot
    be built."""

    name = "cpu_paged"

    def __init__(self) -> None:
        library = load_library()
        self.kernels: dict[torch.dtype, ctypes._CFuncPtr] = {}
        symbols = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
        for dtype, symbol in symbols.items():
            kernel = getattr(library, symbol)
            kernel.argtypes = [*_ARGTYPES, ctypes.c_float]
            kernel.restype = ctypes.c_int
            self.kernels[dtype] = kernel

    def plan(self, batch: Batch) -> CpuPagedPlan:
        groups = super().plan(batch).groups
        lens = [n for n, q in zip(batch.seq_lens, batch.query_lens, strict=True) if q == 1]
        decode_lens = torch.tensor(lens, dtype=torch.int64) if lens else None
        decodes = None
        if decode_lens is not None and len(lens) == len(batch.query_lens):
            tables = groups[0].block_tables.contiguous()
            decodes = DecodeBatch(batch.slot_mapping, tables, decode_lens)
        return CpuPagedPlan(groups=groups, decode_lens=decode_lens, decodes=decodes)

    def attend(
        self,
        queries: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _Group,
        plan: TorchRefPlan,
        scale: float,
    ) -> torch.Tensor:
        kernel = self.kernels.get(queries.dtype)
        lens = getattr(plan, "decode_lens", None)
        if (
            queries.shape[1] != 1
            or kernel is None
            or lens is None
            or k_cache.dtype != queries.dtype
            or k_cache.device.type != "cpu"
        ):
            return super().attend(queries, k_cache, v_cache, group, plan, scale)
        rows, _, n_heads, head_dim = queries.shape
        q = queries.squeeze(1)
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel wants each row's heads contiguous
        tables = group.block_tables
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return super().attend(queries, k_cache, v_cache, group, plan, scale)
        out = torch.empty(rows, n_heads, head_dim, dtype=queries.dtype)
        status = kernel(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            out.data_ptr(),
            rows,
            n_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            scale,
        )
        if status != 0:  # shapes past the kernel's fixed buffers, or out of memory
            return super().attend(queries, k_cache, v_cache, group, plan, scale)
        return out.unsqueeze(1)
