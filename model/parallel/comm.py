"""The collectives a tensor-parallel forward needs, over the default process group."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums the ranks' partial results in place (row-parallel layers). gloo sums no
    bfloat16, so those go over the wire in float32."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        wide = x.float()
        dist.all_reduce(wide)
        x.copy_(wide)
        return x
    dist.all_reduce(x)
    return x


def gather_vocab(x: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, V / N] on each rank -> [T, V]: the logits of every rank's vocabulary rows."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)[:, :vocab_size]
