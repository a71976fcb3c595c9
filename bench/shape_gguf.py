"""A GGUF of a bigger model's shape with random weights, for `make bench --model`: speed
and memory at that scale without its checkpoint (no model hub is reachable here).

The default shape is Llama 3.2 1B's: 16 layers, dim 2048, 32 query heads, 8 KV heads,
FFN 8192, in the default model's types (Q4_1 matrices, a Q8_0 tied embedding) and with its
tokenizer, chat template and vocabulary of 49152, so both servers read it as they read
the default model. Written once into the model cache; prints its path.

    make bench ARGS="--model $(.venv/bin/python -m bench.shape_gguf) --scenarios ae"
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from tqdm import tqdm

from model.checkpoint.default_model import default_model_path
from model.checkpoint.pypi_models import model_cache

SHAPES = {"llama-1b": {"layers": 16, "dim": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192}}
STD = 0.02


def default_vocabulary(writer: GGUFWriter) -> int:
    """Copies the default model's tokenizer (vocabulary, merges, chat template) into
    `writer` as it is, so a server reads the file's text as the default model's; returns
    the vocabulary's size."""
    source = GGUFReader(default_model_path())
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    return int(source.fields["llama.vocab_size"].contents())


def write(shape: str, path: Path, seed: int = 0) -> None:
    s = SHAPES[shape]
    head_dim = s["dim"] // s["heads"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"{shape} shape, random weights")
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["dim"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = default_vocabulary(writer)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * STD).astype(np.float32)

    q4, q8 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
    dim, kv = s["dim"], s["kv_heads"] * head_dim
    tensors = [("token_embd.weight", (vocab, dim), q8), ("output_norm.weight", (dim,), None)]
    for i in range(s["layers"]):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (dim,), None),
            (f"blk.{i}.attn_q.weight", (dim, dim), q4),
            (f"blk.{i}.attn_k.weight", (kv, dim), q4),
            (f"blk.{i}.attn_v.weight", (kv, dim), q4),
            (f"blk.{i}.attn_output.weight", (dim, dim), q4),
            (f"blk.{i}.ffn_norm.weight", (dim,), None),
            (f"blk.{i}.ffn_gate.weight", (s["ffn"], dim), q4),
            (f"blk.{i}.ffn_up.weight", (s["ffn"], dim), q4),
            (f"blk.{i}.ffn_down.weight", (dim, s["ffn"]), q4),
        ]
    for name, shape_, qtype in tqdm(tensors, desc=f"writing {path.name}", unit="tensor"):
        if qtype is None:
            writer.add_tensor(name, np.ones(shape_, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(matrix(*shape_), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def written_once(path: Path, write_to: Callable[[Path], None]) -> Path:
    """`path`, written by `write_to` first when it is not there: under a temporary name,
    then renamed, so an interrupted write never leaves a file that looks whole."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_to(partial)
        partial.replace(path)
    return path


def shape_gguf(shape: str = "llama-1b") -> Path:
    """The cached file, written first when there is none."""
    path = model_cache() / f"{shape}-shape-random-q4_1.gguf"
    return written_once(path, lambda partial: write(shape, partial))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    print(shape_gguf(p.parse_args(argv).shape))


if __name__ == "__main__":
    main()
