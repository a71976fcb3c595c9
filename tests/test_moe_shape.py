"""The MoE benchmark's random GGUF blocks (bench/moe_shape.py), read back by the `gguf`
package's own dequantisation: finite weights of a trained layer's size, in every type the
file uses, so neither server computes on infinities or NaNs."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from bench.moe_shape import EXPERT_FFN, EXPERTS, layer_bytes, layer_tensors
from bench.random_tensors import random_blocks


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_random_blocks_hold_finite_weights_of_a_trained_size(qtype) -> None:
    blocks = random_blocks(np.random.default_rng(0), (3, 64, 512), qtype)
    weights = dequantize(blocks, qtype)
    assert weights.shape == (3, 64, 512)
    assert np.isfinite(weights).all()
    assert 0.002 < float(weights.std()) < 0.2, float(weights.std())


def test_a_layer_has_qwen3_30b_a3b_experts() -> None:
    shapes = {name.split(".")[2]: shape for name, shape, _ in layer_tensors(0)}
    assert shapes["ffn_gate_exps"] == (EXPERTS, EXPERT_FFN, 2048) == (128, 768, 2048)
    assert shapes["ffn_down_exps"] == (128, 2048, 768)
    assert shapes["attn_q"] == (32 * 128, 2048) and shapes["attn_k"] == (4 * 128, 2048)
    # About 0.4 GB a layer as a Q4_K_M file stores it (48 of them: the real 17 GB file).
    assert 0.35e9 < layer_bytes() < 0.45e9
