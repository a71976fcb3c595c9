"""A GGUF at Qwen3-30B-A3B's layer shape with random weights, for the mixture-of-experts
scenarios of `make bench` (x: one stream, y: 8 clients): speed and memory of a real MoE
layer without its 17 GB checkpoint (no model hub is reachable here).

Each layer is Qwen3-30B-A3B's: hidden 2048, 32 query and 4 KV heads of 128 with per-head
Q/K norms, 128 experts of FFN 768, 8 chosen per token. Only the layer count is cut, to
what this machine's memory holds comfortably. Types as a Q4_K_M file has them (Q4_K
gate, up, Q, K and O; Q6_K down, V and output; an F32 router; a Q8_0 embedding), with the
default model's tokenizer and chat template, so both servers read it as a real file.

The quantised blocks are written as random bytes with their scales set small, rather than
quantised from floats: 340 MB of experts a layer would take minutes through numpy.

    make bench ARGS="--scenarios xy"          # written once into the model cache
    .venv/bin/python -m bench.moe_shape --layers 8
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from bench.random_tensors import Tensors, tensor_bytes, write_tensors
from bench.shape_gguf import default_vocabulary, written_once
from model.checkpoint.pypi_models import model_cache

SHAPE = {"dim": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128}
EXPERTS, EXPERTS_USED, EXPERT_FFN = 128, 8, 768
LAYERS_OF_THE_REAL_MODEL = 48


def layer_tensors(i: int) -> Tensors:
    dim, head = SHAPE["dim"], SHAPE["head_dim"]
    q, kv = SHAPE["heads"] * head, SHAPE["kv_heads"] * head
    return [
        (f"blk.{i}.attn_norm.weight", (dim,), None),
        (f"blk.{i}.attn_q.weight", (q, dim), T.Q4_K),
        (f"blk.{i}.attn_k.weight", (kv, dim), T.Q4_K),
        (f"blk.{i}.attn_v.weight", (kv, dim), T.Q6_K),
        (f"blk.{i}.attn_output.weight", (dim, q), T.Q4_K),
        (f"blk.{i}.attn_q_norm.weight", (head,), None),
        (f"blk.{i}.attn_k_norm.weight", (head,), None),
        (f"blk.{i}.ffn_norm.weight", (dim,), None),
        (f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, dim), T.F32),
        (f"blk.{i}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, dim), T.Q4_K),
        (f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, dim), T.Q4_K),
        (f"blk.{i}.ffn_down_exps.weight", (EXPERTS, dim, EXPERT_FFN), T.Q6_K),
    ]


def write(path: Path, layers: int, seed: int = 0) -> None:
    dim, head = SHAPE["dim"], SHAPE["head_dim"]
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_name(f"Qwen3-30B-A3B layer shape, {layers} layers, random weights")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)
    vocab = default_vocabulary(writer)
    tensors = [("token_embd.weight", (vocab, dim), T.Q8_0)]
    tensors += [("output_norm.weight", (dim,), None), ("output.weight", (vocab, dim), T.Q6_K)]
    for i in range(layers):
        tensors += layer_tensors(i)
    write_tensors(writer, path, tensors, seed)


def layer_bytes() -> int:
    return tensor_bytes(layer_tensors(0))


def default_layers() -> int:
    """As many layers as fit in a sixth of this machine's memory: each server in turn
    maps the file, and the page cache holds it between them."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(2, min(LAYERS_OF_THE_REAL_MODEL, memory // 6 // layer_bytes()))


def moe_shape_gguf(layers: int | None = None) -> Path:
    """The cached file, written first when there is none."""
    layers = layers or default_layers()
    path = model_cache() / f"qwen3-30b-a3b-shape-{layers}-layers-random-q4_k_m.gguf"
    return written_once(path, lambda partial: write(partial, layers))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="default: what memory allows")
    print(moe_shape_gguf(p.parse_args(argv).layers))


if __name__ == "__main__":
    main()
