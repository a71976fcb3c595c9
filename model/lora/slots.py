"""`LoraSlots`: the adapters resident at once (--max-loras), stacked per layer and fused
projection, and the batched low-rank update that reads them.

Each fused projection (qkv_proj, gate_up_proj, o_proj, down_proj) holds, per slot, one A
of its targets' A's stacked ([targets * max_rank, in]) and one block-diagonal B ([out,
targets * max_rank]), zero-padded past each adapter's rank, so a group's update is one
shrink and one expand product whatever the ranks. A step's rows are grouped by slot, as
punica and S-LoRA group them: the base projection runs once for the whole batch, then
each group adds `x[rows] @ A.T @ B.T` to its rows. The base weights are never changed,
so quantised bases keep their kernels. Which adapter sits in which slot is the runner's
choice (scheduler/runner/adapters.py); this table only holds tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.config import ModelConfig
from model.lora.adapter import FUSED, LoraAdapter, target_shapes

# out[t] += x[t] @ A[s].T @ B[s].T for each row t of slot s >= 0 (model/lora/triton_update.py).
UpdateKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device | str,
        kernel: UpdateKernel | None = None,
    ) -> None:
        """`kernel`: the update of every row by its own slot in one call (the Triton
        kernels on CUDA, model/lora/triton_update.py); None: grouped PyTorch products."""
        self.kernel = kernel
        self.max_loras = max_loras
        self.max_rank = max_rank
        shapes = target_shapes(config)
        # (layer, fused projection) -> stacked A [slots, targets * rank, in] and B [slots,
        # out, targets * rank], fp32: the update is small next to the base projection, and
        # fp32 keeps it within PEFT's own rounding.
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        # For the C decoder layer (`use_transposed`), bf16: A, and B transposed without the
        # block-diagonal zeros; empty where no layer runs there.
        self.a16: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        # The same bf16 copies again, each slot's in one block [slots, elements] in the
        # order a step reads them (layer by layer: Q/K/V, O, gate/up, down, each A then
        # B^T), and where each (layer, projection)'s A starts in it: a step whose adapter
        # rows all use one slot streams one run of memory, which the C layer reads faster
        # than the same bytes in 120 stacks; a step of several slots reads the stacks, where
        # the slots lie side by side (docs/adapters.md, what it costs).
        self.blocks: torch.Tensor | None = None
        self.block_offsets: dict[tuple[int, str], int] = {}
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # each slot's largest rank
        for layer in range(config.n_layers):
            for fused, targets in FUSED.items():
                width = len(targets) * max_rank
                n_in = shapes[targets[0]][0]
                n_out = sum(shapes[t][1] for t in targets)
                self.a[layer, fused] = torch.zeros(max_loras, width, n_in, device=device)
                self.b[layer, fused] = torch.zeros(max_loras, n_out, width, device=device)
        self._out_offsets = {
            fused: _offsets([shapes[t][1] for t in targets]) for fused, targets in FUSED.items()
        }
        # This step's groups: (slot, the token rows that use it; None: every row).
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.row_slots: torch.Tensor | None = None  # each row's slot, for `kernel`
        self.cpu_row_slots: torch.Tensor | None = None  # each row's slot, int64, on the CPU
        # The last step's key (slots, lengths, device) and its (groups, row_slots, cpu_row_slots).
        self._last_key: tuple[object, ...] | None = None
        self._last: tuple[list, torch.Tensor | None, torch.Tensor | None] = ([], None, None)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._stacks())

    def _stacks(self) -> tuple[torch.Tensor, ...]:
        blocks = () if self.blocks is None else (self.blocks,)
        return (*self.a.values(), *self.b.values(), *self.a16.values(), *self.bt.values(), *blocks)

    def use_transposed(self) -> None:
        """Keeps each A and B also in bf16 on the CPU as the C decoder layer's update
        (model/native/lora_update.c) reads them, B as [slots, rank, out], each output
        column under its own target's rank: row by row, without the block-diagonal zeros.
        bf16 since that layer's step is bound by the bytes it reads (its activations are
        bf16 too); the PyTorch hooks keep reading the fp32 stacks."""
        r = self.max_rank
        for key, b in self.b.items():
            if key in self.bt:
                continue
            bt = torch.zeros(self.max_loras, r, b.shape[1], dtype=torch.bfloat16)
            for index, (start, end) in enumerate(self._out_offsets[key[1]]):
                block = b[:, start:end, index * r : (index + 1) * r]
                bt[:, :, start:end] = block.transpose(1, 2).cpu()
            self.bt[key] = bt
            self.a16[key] = self.a[key].to(device="cpu", dtype=torch.bfloat16)
        if self.blocks is None:
            start = 0
            for key in self.bt:  # (layer, fused) in the order the layers read them
                self.block_offsets[key] = start
                start += self.a16[key][0].numel() + self.bt[key][0].numel()
            self.blocks = torch.zeros(self.max_loras, start, dtype=torch.bfloat16)
            for slot in range(self.max_loras):
                self._fill_block(slot)

    def _fill_block(self, slot: int) -> None:
        """Copies `slot`'s bf16 stacks into its block."""
        assert self.blocks is not None
        for key, start in self.block_offsets.items():
            a, bt = self.a16[key][slot], self.bt[key][slot]
            self.blocks[slot, start : start + a.numel()] = a.flatten()
            self.blocks[slot, start + a.numel() : start + a.numel() + bt.numel()] = bt.flatten()

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Writes `adapter` into `slot`, replacing whatever was there."""
        self.clear(slot)
        r = self.max_rank
        for (layer, fused), a_stack in self.a.items():
            b_stack = self.b[layer, fused]
            for index, target in enumerate(FUSED[fused]):
                pair = adapter.weights.get((layer, target))
                if pair is None:
                    continue
                a, b = pair
                rank = a.shape[0]
                start, end = self._out_offsets[fused][index]
                a_stack[slot, index * r : index * r + rank] = a.to(a_stack.device)
                b_stack[slot, start:end, index * r : index * r + rank] = b.to(b_stack.device)
                if self.bt:
                    self.a16[layer, fused][slot, index * r : index * r + rank] = a
                    self.bt[layer, fused][slot, :rank, start:end] = b.T
        if self.blocks is not None:
            self._fill_block(slot)
        self.ranks[slot] = adapter.max_rank

    def clear(self, slot: int) -> None:
        for stack in self._stacks():
            stack[slot].zero_()
        self.ranks[slot] = 0

    def begin(
        self, seq_slots: list[int] | None, query_lens: list[int], device: torch.device
    ) -> None:
        """Groups this step's token rows by slot (-1: the base model alone). A step of the
        same sequences' slots and lengths as the last one (decodes of an unchanged batch)
        reuses its tensors: nothing writes them, and building them is a few torch calls a
        step."""
        if seq_slots is None:
            self.groups = []
            self.row_slots = self.cpu_row_slots = None
            return
        key = (tuple(seq_slots), tuple(query_lens), device)
        if key != self._last_key:
            self._group(seq_slots, query_lens, device)
            self._last_key = key
            self._last = (self.groups, self.row_slots, self.cpu_row_slots)
        self.groups, self.row_slots, self.cpu_row_slots = self._last

    def _group(self, seq_slots: list[int], query_lens: list[int], device: torch.device) -> None:
        self.groups = []
        self.row_slots = self.cpu_row_slots = None
        if self.kernel is not None or self.bt:
            lengths = torch.tensor(query_lens)
            slots = torch.repeat_interleave(torch.tensor(seq_slots, dtype=torch.int64), lengths)
            if self.kernel is not None:
                self.row_slots = slots.to(device=device, dtype=torch.int32)
            else:
                self.cpu_row_slots = slots
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, length in zip(seq_slots, query_lens, strict=True):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + length))
            start += length
        for slot, indices in rows.items():
            every = len(indices) == start
            index = None if every else torch.tensor(indices, dtype=torch.int64, device=device)
            self.groups.append((slot, index))

    def apply(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds each group's low-rank update to its rows of `out`, the base projection of `x`."""
        a_stack, b_stack = self.a[layer, fused], self.b[layer, fused]
        if self.kernel is not None and self.row_slots is not None:
            self.kernel(x, self.row_slots, a_stack, b_stack, out)
            return
        for slot, index in self.groups:
            xs = x if index is None else x.index_select(0, index)
            delta = (xs.float() @ a_stack[slot].T) @ b_stack[slot].T
            if index is None:
                out.add_(delta.to(out.dtype))
            else:
                out.index_add_(0, index, delta.to(out.dtype))


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out
