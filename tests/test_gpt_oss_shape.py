"""The gpt-oss benchmark's random GGUF (bench/gpt_oss_shape.py): its MXFP4 and Q8_0 blocks
read back by the `gguf` package's own dequantisation as finite weights of a trained
layer's size, and its layer gpt-oss-20b's."""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from bench import gpt_oss_shape as shape


def test_mxfp4_blocks_hold_finite_weights_of_a_trained_size() -> None:
    blocks = shape.mxfp4_blocks(np.random.default_rng(0), (3, 64, 512))
    weights = dequantize(blocks, T.MXFP4)
    assert weights.shape == (3, 64, 512) and np.isfinite(weights).all()
    assert 0.01 < float(weights.std()) < 0.05, float(weights.std())


def test_a_layer_has_gpt_oss_20b_shapes() -> None:
    tensors = {name.split(".", 2)[2]: (s, t) for name, s, t in shape.layer_tensors(0)}
    assert tensors["ffn_gate_exps.weight"] == ((32, 2880, 2880), T.MXFP4)
    assert tensors["ffn_down_exps.bias"] == ((32, 2880), T.F32)
    assert tensors["attn_q.weight"][0] == (64 * 64, 2880)
    assert tensors["attn_k.weight"][0] == (8 * 64, 2880)
    assert tensors["attn_sinks.weight"][0] == (64,)
    # About 0.45 GB a layer (24 of them and the o200k embedding: the real 13 GB file).
    assert 0.4e9 < shape.tensor_bytes(shape.layer_tensors(0)) < 0.5e9
