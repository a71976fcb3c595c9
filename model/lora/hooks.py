"""Hooks `LoraSlots` onto a loaded model without changing its modules: a forward hook on
each fused projection of each decoder layer adds the step's low-rank updates to its
output, and a pre-hook on the model reads the step's adapter rows from the `Batch`.

Hooks rather than wrapped modules, so the projections stay what the kernel plan, the
quantised formats and the C decoder layer know. The C decoder layer (CPU) bypasses the
hooks: it is given bf16 copies of the same stacks and each step's rows
(model/native/lora.py) and adds the update itself; a layer without it runs through
PyTorch in a step with any adapter row (model/network/decoder_layer.py checks `Batch.lora_slots`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.lora.adapter import FUSED
from model.lora.slots import LoraSlots
from model.native.lora import NativeLoraStep
from model.network.batch import Batch


def attach_lora(model: nn.Module, slots: LoraSlots) -> None:
    """Makes `model` (a `Llama`) apply `slots` to every step from now on, in place of
    any table attached before (a model serves one engine at a time)."""
    for handle in getattr(model, "lora_hooks", []):
        handle.remove()
    step = _use_native(model, slots)

    def begin(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        batch: Batch = args[0] if args else kwargs["batch"]
        slots.begin(batch.lora_slots, batch.query_lens, batch.input_ids.device)
        if step is not None:
            step.begin(slots.cpu_row_slots)

    def end(_module: nn.Module, _args: tuple[Any, ...], _out: torch.Tensor) -> None:
        slots.groups = []  # a later forward that skips `begin` must not reuse them
        if step is not None:
            step.begin(None)

    handles = [
        model.register_forward_pre_hook(begin, with_kwargs=True),
        model.register_forward_hook(end),
    ]
    for index, layer in enumerate(model.layers):
        for fused in FUSED:
            hook = _update(slots, index, fused)
            handles.append(getattr(layer, fused).register_forward_hook(hook))
    model.lora_hooks = handles


def _use_native(model: nn.Module, slots: LoraSlots) -> NativeLoraStep | None:
    """Gives every dense layer on the C decoder layer the slots' stacks; the step they
    share, or None where no layer runs there."""
    layers = [
        (index, layer)
        for index, layer in enumerate(model.layers)
        if getattr(layer, "native", None) is not None and layer.moe is None
    ]
    if not layers:
        return None
    slots.use_transposed()
    step = NativeLoraStep(slots.ranks, slots.max_rank, slots.blocks)
    for index, layer in layers:
        a = [slots.a16[index, fused] for fused in FUSED]
        bt = [slots.bt[index, fused] for fused in FUSED]
        offsets = [slots.block_offsets[index, fused] for fused in FUSED]
        layer.native.use_lora(a, bt, offsets, step)
    return step


def _update(slots: LoraSlots, layer: int, fused: str):  # noqa: ANN202 (a hook's signature)
    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if slots.groups:
            slots.apply(layer, fused, inputs[0], out)

    return hook
