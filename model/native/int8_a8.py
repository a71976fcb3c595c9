"""The grouped int8 matmul with int8 activations (int8_matmul_a8.c): int8_matmul.c's packed
bytes (so `pack` and `rows` are NativeInt8Matmul's), each row of x rounded to int8 in groups
of 32 inside the call, as llama.cpp rounds a Q8_0 layer's activations; where a CPU has no
bf16 products (AVX2), a vpmaddwd a pair of weights in place of widening each to fp32."""

from __future__ import annotations

import torch

from model.native.ops import NativeInt8Matmul


class NativeInt8A8Matmul(NativeInt8Matmul):
    """Grouped int8 weights times int8 activations; bf16 output (a decoder layer)."""

    symbol, out_dtype = "int8_matmul_a8", torch.bfloat16


class NativeInt8A8Logits(NativeInt8Matmul):
    """The same with fp32 output: the output projection."""

    symbol, out_dtype = "int8_logits_a8", torch.float32
