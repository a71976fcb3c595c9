"""Hooks `LoraSlots` onto a loaded model without changing its modules: a forward hook on
each fused projection of each decoder layer adds the step's low-rank updates to its
output, and a pre-hook on the model reads the step's adapter rows from the `Batch`.

Hooks rather than wrapped modules, so the projections stay what the kernel plan, the
quantised formats and the C decoder layer know. A step with any adapter row runs the
layers through PyTorch (the C layer would bypass the hooks: model/network/decoder_layer.py
checks `Batch.lora_slots`); a step of base rows only keeps every fast path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.lora.adapter import FUSED
from model.lora.slots import LoraSlots
from model.network.batch import Batch


def attach_lora(model: nn.Module, slots: LoraSlots) -> None:
    """Makes `model` (a `Llama`) apply `slots` to every step from now on, in place of
    any table attached before (a model serves one engine at a time)."""
    for handle in getattr(model, "lora_hooks", []):
        handle.remove()

    def begin(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        batch: Batch = args[0] if args else kwargs["batch"]
        slots.begin(batch.lora_slots, batch.query_lens, batch.input_ids.device)

    def end(_module: nn.Module, _args: tuple[Any, ...], _out: torch.Tensor) -> None:
        slots.groups = []  # a later forward that skips `begin` must not reuse them

    handles = [
        model.register_forward_pre_hook(begin, with_kwargs=True),
        model.register_forward_hook(end),
    ]
    for index, layer in enumerate(model.layers):
        for fused in FUSED:
            hook = _update(slots, index, fused)
            handles.append(getattr(layer, fused).register_forward_hook(hook))
    model.lora_hooks = handles


def _update(slots: LoraSlots, layer: int, fused: str):  # noqa: ANN202 (a hook's signature)
    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if slots.groups:
            slots.apply(layer, fused, inputs[0], out)

    return hook
