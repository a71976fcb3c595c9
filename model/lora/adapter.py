"""`LoraAdapter`: one low-rank adapter as plain tensors, whatever file it came from, and
the one check that it fits the base model it is about to serve with.

An adapter is a set of (layer, projection) pairs, each with A [rank, in] and B [out, rank],
the scaling (alpha / rank, or alpha / sqrt(rank) for rsLoRA) already folded into B, so
that a projection's update is `x @ A.T @ B.T`. Readers (model/lora/peft_dir.py,
model/lora/gguf_lora.py) build it; the resident table (model/lora/slots.py) stacks it.
Nothing here touches the base weights: an adapter is never merged into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig

# The seven projections an adapter may target, under PEFT's names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = TARGETS[:4]
# The model's fused projections (model/network/decoder_layer.py) and the targets whose
# outputs they concatenate, in order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class AdapterError(ValueError):
    """An adapter that cannot serve with this base; the message is one sentence naming the
    adapter and the problem."""


@dataclass
class LoraAdapter:
    name: str
    path: Path
    # (layer index, target) -> (A [rank, in], B [out, rank] with the scaling folded in), fp32.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def max_rank(self) -> int:
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) in the base model: what an adapter's A and B must match."""
    return {
        "q_proj": (config.dim, config.q_size),
        "k_proj": (config.dim, config.kv_size),
        "v_proj": (config.dim, config.kv_size),
        "o_proj": (config.q_size, config.dim),
        "gate_proj": (config.dim, config.ffn_dim),
        "up_proj": (config.dim, config.ffn_dim),
        "down_proj": (config.ffn_dim, config.dim),
    }


def check_fits(adapter: LoraAdapter, config: ModelConfig, max_rank: int | None) -> None:
    """Refuses, in one sentence, an adapter made for another base (a layer it lacks, a
    projection of another shape) or of a rank past `max_rank` (--max-lora-rank)."""
    shapes = target_shapes(config)
    where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
    if not adapter.weights:
        raise AdapterError(f"{where} holds no LoRA weights for any of {', '.join(TARGETS)}")
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        if layer >= config.n_layers:
            raise AdapterError(
                f"{where} adapts layer {layer}, but the base model has {config.n_layers} layers"
            )
        want_in, want_out = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"{where}: layer {layer} {target} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, which do not make a low-rank pair"
            )
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise AdapterError(
                f"{where} was made for another base model: layer {layer} {target} maps "
                f"{a.shape[1]} -> {b.shape[0]}, the base's maps {want_in} -> {want_out}"
            )
        if max_rank is not None and a.shape[0] > max_rank:
            raise AdapterError(
                f"{where} has rank {a.shape[0]} at layer {layer} {target}, past "
                f"--max-lora-rank {max_rank}"
            )
