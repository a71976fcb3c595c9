"""Paged attention on the CPU in a C kernel that reads K and V in place, one query per row.

The reference gathers each decoding sequence's padded context into a new tensor, casts it
to fp32 and runs two batched products per KV head: several passes over the whole context,
per layer and per step, so a step's host work grows with context length (at 8 sequences
of 400 tokens it was half the step). The C kernel (model/native/paged_decode.c) walks each
sequence's block table once, in fp32; on a 2-core AVX-512 machine it reads K/V at close
to memory bandwidth, and decode steps of 16 sequences of 550 tokens went from 184 to 76 ms.

Attention sinks (gpt-oss) join each softmax's denominator in the kernel as in the reference.

Prefill chunks in bf16 run on it too, each query as a row of its own that sees its
position + 1 tokens, so a query's result is the same bits as a decode's and the same
however its prompt was chunked or recomputed after preemption: SDPA would round a chunk
differently from the decode loop, and greedy tokens then changed with chunking on every
CPU without the kernel's AVX-512 path. That path is also faster (SDPA with the causal
mask as a tensor computed every masked product as well, 140 ms of a 512-token prefill's
~360 ms on the default model); the AVX2 path is on a par with SDPA (4.7 against 4.8-5.2
ms per layer at 512 tokens); only the portable loops cost about twice SDPA's time, the
price of that invariance there. fp32 prefills keep the reference's SDPA, faster there
than the kernel's float32 loop (a 512-token prefill of the default model 0.81 against
0.97 s), except under --batch-invariant (model/row_invariant.py). A sequence's result
does not depend on the rest of its batch (the kernel handles each query alone), so batch
invariance holds as with the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from model.attention.torch_ref import TorchRefBackend, TorchRefPlan, _Group
from model.native.int8_cache import kv_int8_writers, paged_decode_int8_kernels
from model.native.layer import DecodeBatch
from model.native.ops import paged_decode_kernels
from model.network.batch import Batch


@dataclass
class CpuPagedPlan(TorchRefPlan):
    decode_lens: torch.Tensor | None = None  # [decodes] int64: the decode group's lengths
    # A step of decodes only, for decoder layers that run whole in C (model/native/layer.py).
    decodes: DecodeBatch | None = None
    # The prefill group as one-query rows, one per (row, query) slot of its padded
    # [B, max_q] layout: each slot's block table and the length its query sees (its own
    # position + 1; 1 for padding slots, whose outputs are discarded).
    prefill_tables: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None


# Prefill chunks of at most this many queries a sequence take the C kernel in float32 too.
SHORT_PREFILL = 16


class CpuPagedBackend(TorchRefBackend):
    """Raises NativeUnavailable (model/native/build.py) where the kernel cannot
    be built."""

    name = "cpu_paged"
    # --batch-invariant: float32 prefills on the kernel too, however long (model/row_invariant.py).
    every_query_alone = False

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        self.kernels = paged_decode_kernels(library)
        # Over an int8 cache (model/network/kv_int8.py), per query dtype.
        self.int8_kernels = paged_decode_int8_kernels(library)
        self.int8_writers = kv_int8_writers(library)

    def plan(self, batch: Batch) -> CpuPagedPlan:
        plan = CpuPagedPlan(batch)
        if batch.query_lens and all(q == 1 for q in batch.query_lens):
            # Decodes only: the batch's own tensors are the C layers' whole plan (the
            # kernel reads each table only as far as its row's length).
            plan.decode_lens = batch.seq_lens_t
            plan.decodes = DecodeBatch(batch.slot_mapping, batch.block_tables, batch.seq_lens_t)
            return plan
        lens = [n for n, q in zip(batch.seq_lens, batch.query_lens, strict=True) if q == 1]
        plan.decode_lens = torch.tensor(lens, dtype=torch.int64) if lens else None
        prefills = [(n, q) for n, q in zip(batch.seq_lens, batch.query_lens, strict=True) if q > 1]
        if prefills:
            group = plan.groups[-1]
            rows, max_q = group.token_index.shape
            seq_lens = torch.tensor([n for n, _ in prefills], dtype=torch.int64)
            query_lens = torch.tensor([q for _, q in prefills], dtype=torch.int64)
            cols = torch.arange(max_q, dtype=torch.int64)
            seen = (seq_lens - query_lens)[:, None] + cols[None, :] + 1
            valid = cols[None, :] < query_lens[:, None]
            plan.prefill_lens = torch.where(valid, seen, 1).reshape(-1)
            plan.prefill_tables = group.block_tables.repeat_interleave(max_q, dim=0)
        return plan

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Into an int8 cache in C: kv_int8.quantize's dozen tensor operations per cache
        and layer cost a 64-token prefill chunk of Qwen2.5-0.5B several ms a step."""
        writer = self.int8_writers.get(k.dtype) if k_cache.dtype == torch.int8 else None
        contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
        if writer is None or k_cache.device.type != "cpu" or not contiguous:
            return super().write_kv(k, v, k_cache, v_cache, slot_mapping)
        n_kv, head_dim = k.shape[1], k.shape[2]
        slots = slot_mapping.contiguous()
        for x, cache in ((k, k_cache), (v, v_cache)):
            if x.stride(2) != 1 or x.stride(1) != head_dim:
                x = x.contiguous()  # the writer wants each row's heads contiguous
            writer(
                x.data_ptr(), x.stride(0), x.shape[0], slots.data_ptr(),
                cache.data_ptr(), n_kv, head_dim,
            )  # fmt: skip

    def attend(
        self,
        queries: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _Group,
        plan: TorchRefPlan,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, max_q, n_heads, head_dim = queries.shape
        if max_q == 1:
            tables, lens = group.block_tables, getattr(plan, "decode_lens", None)
        elif (
            isinstance(plan, CpuPagedPlan)
            and plan.prefill_lens is not None
            and (
                queries.dtype == torch.bfloat16 or max_q <= SHORT_PREFILL or self.every_query_alone
            )
        ):
            # Each query of a prefill chunk as a decode of its own: the C kernel reads K
            # and V in place and skips what the causal mask would hide, where SDPA with a
            # mask computed every masked product (140 of a 512-token prefill's ~360 ms).
            # In float32 only for a few queries (the kernel has no vector loop for it):
            # a speculating sequence's verification rows then attend as its decodes do.
            tables, lens = plan.prefill_tables, plan.prefill_lens
        else:
            tables = lens = None
        out = None
        if lens is not None:
            flat = queries.reshape(rows * max_q, n_heads, head_dim)
            out = self._run(flat, k_cache, v_cache, tables, lens, scale, window, sinks)
        if out is None:
            return super().attend(queries, k_cache, v_cache, group, plan, scale, window, sinks)
        return out.view(rows, max_q, n_heads, head_dim)

    def _run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One query per row of q [rows, n_heads, head_dim] over `lens` tokens of its
        table; None where the kernel does not apply."""
        int8 = k_cache.dtype == torch.int8
        if int8:  # the int8 kernel has no sinks: gpt-oss over an int8 cache takes the reference
            kernel = self.int8_kernels.get(q.dtype) if sinks is None else None
        else:
            kernel = self.kernels.get(q.dtype) if k_cache.dtype == q.dtype else None
        if (
            kernel is None
            or k_cache.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            return None
        rows, n_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel wants each row's heads contiguous
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        out = torch.empty(rows, n_heads, head_dim, dtype=q.dtype)
        # The sink logits in fp32, as the kernel's softmax is (a gpt-oss model's are few).
        sinks = sinks.detach().float().contiguous() if sinks is not None else None
        sink_arg = () if int8 else (sinks.data_ptr() if sinks is not None else None,)
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
            window or 0,
            *sink_arg,
        )
        # Non-zero: shapes past the kernel's fixed buffers, or out of memory.
        return out if status == 0 else None
