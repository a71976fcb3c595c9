"""`RopeScaling`: how a checkpoint stretches its rotary embeddings past the context it was
trained on (linear, Llama 3's smooth band, YaRN), read from an HF `rope_parameters` or
`rope_scaling` dict or from GGUF's `rope.scaling.*` keys. Plain values only: the tables
themselves are model/network/rope.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (gpt-oss): the band between beta_fast and beta_slow rotations is interpolated,
    # its bounds rounded outwards where `truncate`, and cos/sin scaled by `attention_factor`
    # (None: 0.1 ln(factor) + 1, as transformers infers it).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


def rope_scaling(rope: dict[str, Any], source: str) -> RopeScaling:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope scaling type {rope_type!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "yarn" and (rope.get("mscale") or rope.get("mscale_all_dim")):
        raise UnsupportedModelError(f"{source}: YaRN with mscale is not supported")
    attention_factor = rope.get("attention_factor")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )
