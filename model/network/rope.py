"""Rotary position embeddings with a precomputed cos/sin table.

Internally llamaserve uses the HF layout: each head rotates its two halves
(x[i], x[i + d/2]). Checkpoints stored with interleaved pairs (GGUF, Meta) are permuted
into this layout when their Q/K weights are loaded, never here.
"""

import dataclasses
import math

import torch

from model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, and the band
    # between them interpolated smoothly, so short-range attention is unchanged.
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN, as transformers' `_compute_yarn_parameters`: dimensions that turn more than
    `beta_fast` times over the original context keep their frequency, those that turn less
    than `beta_slow` times are divided by `factor`, and a linear ramp joins the two."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)

    def correction_dim(rotations: float) -> float:
        turns = scaling.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return 1.0 / (scaling.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def attention_factor(scaling: RopeScaling) -> float:
    """YaRN's scale of cos and sin (so of every attention logit, squared): the checkpoint's,
    or 0.1 ln(factor) + 1; 1 for the other scalings."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        # fp32 angles whatever the model dtype: positions past a few thousand lose whole
        # radians in bf16.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        factor = attention_factor(config.rope_scaling)
        self.register_buffer("cos", (angles.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (angles.sin() * factor).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the batch's positions, [T, 1, head_dim / 2]: looked up once per
        forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], any heads: the model rotates its Q and K heads together,
    in one pass (half the small ops of a decode step's RoPE)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def rotary_embeddings(
    config: ModelConfig, max_position: int | None, device: torch.device | str
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The RoPE tables of the global layers, and of the windowed ones where their base
    differs (Gemma 3: 10000 against 1e6, unscaled)."""
    length = max_position or config.max_position
    rope = RotaryEmbedding(config, length, device)
    if config.rope_local_theta is None:
        return rope, None
    local = dataclasses.replace(
        config, rope_theta=config.rope_local_theta, rope_scaling=RopeScaling()
    )
    return rope, RotaryEmbedding(local, length, device)
