"""The MXFP4 matmul on CUDA in one Triton kernel: x [M, K] times a weight held in GGUF's
MXFP4 blocks (model/checkpoint/mxfp4.py), decoded in registers one block of 32 at a time,
never to memory. Each program takes a tile of rows and output columns; the E2M1 values
are computed from the nibble's bits (no table lookup in Triton) doubled, as ggml keeps
them, times the halved scale 2^(e - 128) built from the scale byte's bits: both exact in
fp32, so the products are the dequantised weight's, summed in fp32 (`ieee`: no TF32).

Without a GPU the same source runs under Triton's interpreter, held to the dequantised
product by tests/test_mxfp4.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.checkpoint.mxfp4 import BLOCK, BLOCK_BYTES

BLOCK_M = 16  # tl.dot's smallest tile
BLOCK_N = 32


@triton.jit
def _doubled_e2m1(q):
    """Nibbles (int32) -> their E2M1 values doubled, as fp32: 0, 1, 2, 3, 4, 6, 8, 12 by
    the low 3 bits (exponent e, mantissa m: m where e = 0, else (2 + m) 2^(e - 1)), bit 3
    the sign."""
    e = (q >> 1) & 3
    m = q & 1
    magnitude = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    return tl.where(q >= 8, -magnitude, magnitude).to(tl.float32)


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 16)
    row_bytes = (K // 32) * 17
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, K // 32):
        block = w_ptr + cols * row_bytes + b * 17  # [BLOCK_N]
        e = tl.load(block, mask=cols < N, other=0).to(tl.int32)
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        scale = bits.to(tl.float32, bitcast=True)
        q = tl.load(block[:, None] + 1 + half[None, :], mask=(cols < N)[:, None], other=0)
        q = q.to(tl.int32)
        low = _doubled_e2m1(q & 15) * scale[:, None]  # weights 0..15 of the block
        high = _doubled_e2m1(q >> 4) * scale[:, None]  # 16..31
        x_at = x_ptr + rows[:, None] * stride_xm + b * 32 + half[None, :]
        x_mask = (rows < M)[:, None]
        x_low = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        x_high = tl.load(x_at + 16, mask=x_mask, other=0.0).to(tl.float32)
        acc += tl.dot(x_low, tl.trans(low), input_precision="ieee")
        acc += tl.dot(x_high, tl.trans(high), input_precision="ieee")
    y_at = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def mxfp4_matmul(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] (each row contiguous) times weight [out, K / 32 * 17] uint8 MXFP4 blocks:
    [M, out] in x's dtype."""
    rows, in_features = x.shape
    if in_features % BLOCK or weight.shape[-1] != in_features // BLOCK * BLOCK_BYTES:
        raise ValueError(f"MXFP4 weight {tuple(weight.shape)} does not fit rows of {in_features}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _mxfp4_matmul_kernel[grid](
        x,
        weight,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        y.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    return y
