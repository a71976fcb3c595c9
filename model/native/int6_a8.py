"""The 6-bit matmul with int8 activations (int6_matmul_a8.c): int6_matmul.c's packed bytes
(so `pack` is NativeInt6Matmul's), each row of x rounded to int8 in groups of 32 inside the
call, as llama.cpp rounds a Q6_K layer's activations; where a CPU has no bf16 products
(AVX2), several times fewer instructions than widening every weight to fp32."""

from __future__ import annotations

import torch

from model.native.ops import NativeInt6Matmul


class NativeInt6A8Matmul(NativeInt6Matmul):
    """int6 weights times int8 activations; bf16 output (a decoder layer)."""

    symbol, out_dtype = "int6_matmul_a8", torch.bfloat16


class NativeInt6A8Logits(NativeInt6Matmul):
    """The same with fp32 output: the output projection."""

    symbol, out_dtype = "int6_logits_a8", torch.float32
