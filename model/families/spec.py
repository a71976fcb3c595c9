"""`Family`: what sets one architecture's checkpoints apart from Llama's, stated once.

A family names the HF `model_type`s and the GGUF `general.architecture` it reads, and
turns the family-specific fields of a config into `ModelConfig` fields; the layer itself
reads those fields (model/network/llama.py). Families never touch tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Fields = dict[str, Any]


def _no_fields(cfg: dict[str, Any], source: str) -> Fields:
    return {}


def _as_stored(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    return name, tensor


Adapted = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    # llama.cpp's converter reorders Q/K rows into interleaved pairs for the architectures
    # its graph rotates that way (`llama`); the NeoX-style ones (Qwen, Gemma) keep HF's halves.
    gguf_permutes_qk: bool
    # Extra `ModelConfig` fields from an HF config.json, refusing what the family cannot run.
    hf_fields: Callable[[dict[str, Any], str], Fields] = _no_fields
    # The same from GGUF metadata, keys already stripped of the "<arch>." prefix.
    gguf_fields: Callable[[dict[str, Any], str], Fields] = _no_fields
    # An HF checkpoint's tensor -> the name and value `Llama.load_weights` takes, where the
    # family names or stores them differently (Gemma's norms).
    adapt_hf: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]] = _as_stored
    # GGUF's `general.architecture` where llama.cpp spells it otherwise (`qwen3moe`).
    gguf_architecture: str | None = None
    # Where one HF tensor holds several of ours (gpt-oss's stacked experts): the tensors it
    # splits into, under the names `adapt_hf` would give; None: `adapt_hf` alone.
    split_hf: Callable[[str, torch.Tensor], Adapted] | None = None
    # GGUF tensor kinds ('post_attention_norm') that mean another HF name in this family.
    gguf_names: Mapping[str, str] | None = None

    def hf_tensors(self, name: str, tensor: torch.Tensor) -> Adapted:
        """An HF checkpoint's tensor as the tensors `Llama.load_weights` takes."""
        if self.split_hf is not None:
            return self.split_hf(name, tensor)
        return (self.adapt_hf(name, tensor),)

    @property
    def gguf_name(self) -> str:
        return self.gguf_architecture or self.name
