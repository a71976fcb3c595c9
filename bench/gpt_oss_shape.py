"""A GGUF at gpt-oss-20b's layer shape with random weights, for the gpt-oss scenarios of
`make bench` (g: one stream, h: 8 clients): speed and memory of its layer, experts held
in MXFP4, without its 13 GB checkpoint (no model hub is reachable here).

Each layer is gpt-oss-20b's: hidden 2880, 64 query and 8 KV heads of 64 with biases on
Q, K, V and O and a sink logit per head, a 128-token sliding window on the even layers,
YaRN RoPE (factor 32 over 4096 positions, base 150000), 32 experts of FFN 2880 with
biases, 4 chosen per token by a biased router. Only the layer count is cut, to what fits
comfortably in about 6 GB. Types as llama.cpp's own gpt-oss GGUF has them: the experts
in MXFP4, attention, embedding and output in Q8_0 (both servers hold Q8_0 as it is),
biases, sinks, router and norms in F32; the default model's tokenizer and chat template,
so both servers read it as a real file.

The MXFP4 and Q8_0 blocks are random bytes with their scales set small rather than
quantised from floats (430 MB of experts a layer would take minutes through numpy).

    make bench ARGS="--scenarios gh"          # written once into the model cache
    .venv/bin/python -m bench.gpt_oss_shape --layers 2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType

from bench.random_tensors import Tensors, tensor_bytes, write_tensors
from bench.shape_gguf import default_vocabulary, written_once
from model.checkpoint.pypi_models import model_cache

DIM, HEADS, KV_HEADS, HEAD_DIM = 2880, 64, 8, 64
EXPERTS, EXPERTS_USED, EXPERT_FFN = 32, 4, 2880
WINDOW, LAYERS_OF_THE_REAL_MODEL = 128, 24
# An E8M0 scale byte of 120 (2^-8 on ggml's doubled E2M1 values): weights of about 0.02,
# at most 0.047, a trained layer's size.
MXFP4_SCALE = 120
BUDGET = 6 * 10**9


def mxfp4_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """MXFP4 blocks holding `shape` weights (last dimension in weights), as bytes."""
    *lead, cols = shape
    raw = rng.integers(0, 256, (*lead, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = MXFP4_SCALE
    return raw.reshape(*lead, cols // 32 * 17)


def layer_tensors(i: int) -> Tensors:
    """(name, shape in torch's order, block type; None for a norm's ones, F32 for small
    random floats)."""
    q, kv, blk = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, f"blk.{i}"
    tensors: Tensors = [
        (f"{blk}.attn_norm.weight", (DIM,), None),
        (f"{blk}.post_attention_norm.weight", (DIM,), None),
        (f"{blk}.attn_sinks.weight", (HEADS,), T.F32),
        (f"{blk}.ffn_gate_inp.weight", (EXPERTS, DIM), T.F32),
        (f"{blk}.ffn_gate_inp.bias", (EXPERTS,), T.F32),
    ]
    for name, rows, cols in (("q", q, DIM), ("k", kv, DIM), ("v", kv, DIM), ("output", DIM, q)):
        tensors.append((f"{blk}.attn_{name}.weight", (rows, cols), T.Q8_0))
        tensors.append((f"{blk}.attn_{name}.bias", (rows,), T.F32))
    for name, rows, cols in (
        ("gate", EXPERT_FFN, DIM),
        ("up", EXPERT_FFN, DIM),
        ("down", DIM, EXPERT_FFN),
    ):
        tensors.append((f"{blk}.ffn_{name}_exps.weight", (EXPERTS, rows, cols), T.MXFP4))
        tensors.append((f"{blk}.ffn_{name}_exps.bias", (EXPERTS, rows), T.F32))
    return tensors


def _add_metadata(writer: GGUFWriter, layers: int) -> None:
    writer.add_name(f"gpt-oss-20b layer shape, {layers} layers, random weights")
    writer.add_block_count(layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(EXPERT_FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(150000.0)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_sliding_window(WINDOW)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)


def write(path: Path, layers: int, seed: int = 0) -> None:
    writer = GGUFWriter(str(path), "gpt-oss")
    _add_metadata(writer, layers)
    vocab = default_vocabulary(writer)
    tensors = [("token_embd.weight", (vocab, DIM), T.Q8_0)]
    tensors += [("output_norm.weight", (DIM,), None), ("output.weight", (vocab, DIM), T.Q8_0)]
    for i in range(layers):
        tensors += layer_tensors(i)
    write_tensors(writer, path, tensors, seed, blocks={T.MXFP4: mxfp4_blocks})


def default_layers(vocab: int = 49152) -> int:
    """As many layers as fit in 6 GB (a quarter of this machine's memory where that is
    less), beside the embedding and output: each server in turn maps the file, and the
    page cache holds it between them."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = min(BUDGET, memory // 4) - 2 * tensor_bytes([("", (vocab, DIM), T.Q8_0)])
    return max(2, min(LAYERS_OF_THE_REAL_MODEL, budget // tensor_bytes(layer_tensors(0))))


def gpt_oss_shape_gguf(layers: int | None = None) -> Path:
    """The cached file, written first when there is none."""
    layers = layers or default_layers()
    path = model_cache() / f"gpt-oss-20b-shape-{layers}-layers-random-mxfp4.gguf"
    return written_once(path, lambda partial: write(partial, layers))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="default: what fits in about 6 GB")
    print(gpt_oss_shape_gguf(p.parse_args(argv).layers))


if __name__ == "__main__":
    main()
