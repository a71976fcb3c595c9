"""Where a group of 32 weights read from a GGUF file already lies on a 4-bit grid, so it
requantises into int4 (model/quant/int4.py) without loss, and sorting groups fast
enough for loading a 1.5B model's worth of them. Only for values that arrive dequantised
(a tensor-parallel rank's slices): on one process a layer reads the grid from the file's
blocks (model/checkpoint/file_blocks.py)."""

from __future__ import annotations

import numpy as np
import torch


def file_grid(groups: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a group of 32 already lies on a grid of at most 16 steps (a GGUF 4-bit block:
    Q4_1's or Q4_K's sub-block, w = step * q + min), that step, so the group requantises
    without loss; its own min-to-max span need not reach 15 steps (Q4_K's quantiser often
    leaves the ends unused, and spreading them over 15 steps moved its weights by 4%).
    Returns (found, step) per group. A group that spans all 16 levels is on the grid of
    its span over 15; only the others are sorted for their smallest gap (sorting every
    group took 24 of the 46 s Qwen2.5-Coder-1.5B's Q4_K_M file loaded in)."""
    span = groups.amax(dim=-1, keepdim=True) - low
    step = span / 15.0
    found = _on_grid(groups, low, step) & (span > 0)
    rest = ~found.squeeze(-1)
    if bool(rest.any()):
        some, some_low, some_span = groups[rest], low[rest], span[rest]
        ordered = sorted_groups(some)
        gaps = ordered[..., 1:] - ordered[..., :-1]
        tolerance = some_span * 1e-4
        gap = gaps.masked_fill(gaps <= tolerance, float("inf")).amin(dim=-1, keepdim=True)
        found[rest] = _on_grid(some, some_low, gap) & (some_span > 0)
        step[rest] = gap
    return found, step


def sorted_groups(groups: torch.Tensor) -> torch.Tensor:
    """Each group's values in ascending order: NumPy's sort on the CPU, about 3x PyTorch's
    for rows of 32."""
    if groups.device.type != "cpu":
        return groups.sort(dim=-1).values
    return torch.from_numpy(np.sort(groups.numpy(), axis=-1))


def _on_grid(groups: torch.Tensor, low: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Whether each group is low + step * q for whole q in 0..15."""
    steps = (groups - low) / step
    on_grid = (steps - steps.round()).abs().amax(dim=-1, keepdim=True) < 1e-3
    return on_grid & (steps.amax(dim=-1, keepdim=True).round() <= 15)
