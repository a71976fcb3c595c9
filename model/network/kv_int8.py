"""The int8 KV cache (`--kv-cache-dtype int8`): the layout of a slot, and K/V quantised
into it and back. Every attention path (the PyTorch reference, the C kernels in
model/native/paged_decode_int8.c, the Triton kernels) reads and writes this layout; the
C writer rounds exactly as `quantize` does, which the tests hold it to.

A slot is one token's K (or V) for one KV head: `head_dim` int8 values, then their bf16
scale in the next 2 bytes, all in one int8 tensor whose last dimension is
`head_dim + SCALE_BYTES`. The scale sits beside its values, so a block is still one
contiguous run of bytes and every interface that hands caches around stays as it is.

One scale per token and head, not one per block and head: a token's bytes then depend on
its own K/V alone, never on which tokens were written to its block before or with it, so
a prompt cached in one chunk or many, alone or in a crowded batch, recomputed after
preemption or shared through the prefix cache holds the same bytes (a block's scale would
have to be fixed by its first token or rewritten as the block fills). It costs 2 bytes
per 64 values, a cache of 1.94x bf16's tokens in the same memory at head_dim 64.

The scale is rounded to bf16 before the values are divided by it, so the stored scale is
exactly the one they were quantised with: value = q * scale, |q| <= 127.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 2  # one bf16 per slot
QMAX = 127.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for `--kv-cache-dtype`: "auto" keeps the model's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose one of {choices}")
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def slot_width(head_dim: int) -> int:
    """Bytes of one (token, KV head) slot."""
    return head_dim + SCALE_BYTES


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> int8 [..., head_dim + 2]: the values, then
    the bf16 scale's two bytes (little-endian, as the C and Triton kernels read them)."""
    xf = x.float()
    # Multiplied by 1/127 rather than divided by 127: the C writer's fast math turns a
    # division by a constant into this product, and both must round alike.
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / QMAX)).to(torch.bfloat16)
    wide = scale.float()
    inverse = torch.where(wide > 0, 1.0 / wide, torch.zeros_like(wide))  # an all-zero head
    q = torch.round(xf * inverse).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(slots: torch.Tensor) -> torch.Tensor:
    """int8 slots [..., head_dim + 2] -> float32 [..., head_dim]."""
    head_dim = slots.shape[-1] - SCALE_BYTES
    scale = slots[..., head_dim:].view(torch.bfloat16).float()
    return slots[..., :head_dim].float() * scale
