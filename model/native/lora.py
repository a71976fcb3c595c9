"""LoRA adapters on the C decoder layer (lora_update.c): the step's rows and slots every
layer reads (`NativeLoraStep`, one per model), and the pointers to the resident slots'
stacks each layer holds (`NativeDecoderLayer.use_lora`).

One struct shared by all layers, rewritten once per step, rather than an argument to each
layer call: a step's adapter rows are the same in every layer, and the layer calls keep
their signatures.
"""

from __future__ import annotations

import ctypes

import torch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _LoraStep(ctypes.Structure):
    """lora_step.h's `lora_step`: same fields, same order."""

    _fields_ = [
        ("row_slots", _PTR),
        ("ranks", _PTR),
        ("n_slots", _I64),
        ("max_rank", _I64),
        ("blocks", _PTR),
        ("block_stride", _I64),
    ]


class NativeLoraStep:
    """What the C layers read of a step: each token row's slot (-1: the base alone) and
    each slot's rank. `ranks` is the slots' own tensor, updated in place as adapters load;
    `blocks` [slots, elements] bf16, each slot's copies in one block (model/lora/slots.py),
    read by a step whose adapter rows all use one slot; None: the stacks alone."""

    def __init__(
        self, ranks: torch.Tensor, max_rank: int, blocks: torch.Tensor | None = None
    ) -> None:
        assert ranks.dtype == torch.int64 and ranks.is_contiguous()
        self._ranks = ranks
        self._blocks = blocks  # referenced while the C layers read it
        self._rows: torch.Tensor | None = None
        self.struct = _LoraStep(None, ranks.data_ptr(), ranks.numel(), max_rank, None, 0)
        if blocks is not None:
            assert blocks.dtype == torch.bfloat16 and blocks.is_contiguous()
            self.struct.blocks = blocks.data_ptr()
            self.struct.block_stride = blocks.shape[1]
        self.pointer = ctypes.addressof(self.struct)

    def begin(self, row_slots: torch.Tensor | None) -> None:
        """This step's slot per token row (int64 on the CPU), or None for a step of base
        rows only."""
        self._rows = row_slots
        self.struct.row_slots = row_slots.data_ptr() if row_slots is not None else None
