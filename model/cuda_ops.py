"""Triton kernels for the CUDA path's per-token small ops: RMSNorm and RoPE in one kernel
each.

In PyTorch an RMSNorm is about eight kernels (casts, square, mean, eps, rsqrt, two
multiplies) and RoPE about nine; at batch 1 each costs its ~1.5 us launch-and-drain on a
GPU whatever its size, which on an 8B model is over a millisecond of an 8 ms decode step.
Each kernel here reads its row once and writes it once, in the same formula as the PyTorch
code it stands in for (fp32 inside, rounded where that code rounds), so a row's result does
not depend on the batch it is in. Both return None for layouts they do not take, and the
caller falls back to PyTorch.

Like the attention kernels they run on CPU tensors under Triton's interpreter, which is how
CI holds them to the PyTorch formulas."""

import torch
import triton
import triton.language as tl

from model.attention.kernels import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    # Rounded to the input dtype as PyTorch's code does, then multiplied exactly in fp32 and
    # rounded once: what a bf16 product is (and Triton's interpreter multiplies bf16 wrongly).
    normed = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


class TritonRmsNorm:
    """`RMSNorm.native` on CUDA tensors: rows of a 2-D view (any row stride), one program
    per row."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        if x.device.type != weight.device.type or x.stride(-1) != 1 or x.numel() == 0:
            return None
        rows = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x
        if rows.dim() != 2:
            return None  # a strided 3-D view (Qwen3's per-head norms of a split): PyTorch
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            rows.stride(0),
            out.stride(0),
            rows.shape[1],
            eps,
            BLOCK=next_power_of_2(rows.shape[1]),
        )
        return out.view(x.shape)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    dims = tl.arange(0, BLOCK)
    mask = dims < HALF
    src = x_ptr + token * stride_xt + head * stride_xh + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_ct + dims, mask=mask, other=0.0)
    dest = out_ptr + (token * n_heads + head) * 2 * HALF + dims
    dtype = out_ptr.dtype.element_ty
    tl.store(dest, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dest + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def triton_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`apply_rope` in one kernel: x [T, heads, head_dim] with contiguous heads (the view
    of the fused QKV output the layer hands it), cos and sin [T, 1, head_dim / 2] fp32.
    The result is a new contiguous tensor in x's dtype."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if (
        x.device.type != cos.device.type
        or x.stride(2) != 1
        or x.stride(1) != head_dim
        or cos.dtype != torch.float32
        or cos.shape != (tokens, 1, half)
        or not (cos.is_contiguous() and sin.is_contiguous())
        or tokens == 0
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rope_kernel[(tokens, heads)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=half,
        BLOCK=next_power_of_2(half),
    )
    return out
