"""The LoRA update on CUDA in two Triton kernels, as punica's BGMV does it: each token row
reads its own adapter's slot (`row_slots`, -1: none), the shrink kernel takes it to the
rank (`x @ A.T`), the expand kernel back to the output (`@ B.T`) and adds it to the base
projection in place. One launch pair per projection whatever the mix of adapters, and no
host synchronisation, so a step's adapters cost no Python loop on the GPU.

Without a GPU the same source runs under Triton's interpreter, held to the PyTorch
grouping in model/lora/slots.py by tests/test_lora.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
            a_mask = (ranks[:, None] < R) & (ks[None, :] < K)
            a_at = a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :]
            a = tl.load(a_at, mask=a_mask, other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(h_ptr + token * BLOCK_R + ranks, acc)


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    N,
    R,
    stride_bs,
    stride_bn,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + token * BLOCK_R + ranks)
        b_mask = (ns[:, None] < N) & (ranks[None, :] < R)
        b_at = b_ptr + slot * stride_bs + ns[:, None] * stride_bn + ranks[None, :]
        b = tl.load(b_at, mask=b_mask, other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        out_at = out_ptr + token * stride_ot + ns
        base = tl.load(out_at, mask=ns < N, other=0.0).to(tl.float32)
        tl.store(out_at, (base + delta).to(out_ptr.dtype.element_ty), mask=ns < N)


def lora_update(
    x: torch.Tensor,
    row_slots: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t] += x[t] @ A[s].T @ B[s].T for each row t whose slot s = row_slots[t] >= 0.
    x: [T, K]; a_stack: [slots, R, K]; b_stack: [slots, N, R]; out: [T, N]; the last
    dimension of each contiguous."""
    x = x.contiguous()
    num_tokens, k = x.shape
    _, r, _ = a_stack.shape
    n = b_stack.shape[1]
    if num_tokens == 0:
        return
    block_r = max(16, triton.next_power_of_2(r))
    h = torch.zeros(num_tokens, block_r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens,)](
        x, a_stack, row_slots, h, k, r, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(num_tokens, triton.cdiv(n, BLOCK_N))](
        h, b_stack, row_slots, out, n, r, b_stack.stride(0), b_stack.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_N=BLOCK_N,
    )  # fmt: skip
