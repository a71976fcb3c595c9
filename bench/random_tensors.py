"""The tensors of the random-weight shape files (`bench/moe_shape.py`,
`bench/gpt_oss_shape.py`): quantised blocks written as random bytes with small scales, and
the loop that writes a list of them into a GGUF with a progress bar.

Random bytes rather than quantised floats: a layer of experts holds hundreds of MB, which
numpy's quantisers would take minutes over. Each block type's scales are set so that the
weights come out about 0.02, a trained layer's size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from tqdm import tqdm

# (name, shape in torch's order, block type: None for a norm's ones, F32 for small floats)
Tensors = list[tuple[str, tuple[int, ...], T | None]]
# Half-precision block scales that give weights of about 0.02.
SCALES = {T.Q4_K: (1e-4, 4e-4), T.Q6_K: (2e-5, 0.0)}


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: T) -> np.ndarray:
    """Blocks of `qtype` holding `shape` weights (last dimension in weights), as bytes."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    raw = rng.integers(0, 256, (*lead, cols // per_block, block_bytes), dtype=np.uint8)
    if qtype in SCALES:
        d, dmin = SCALES[qtype]
        if qtype == T.Q4_K:  # d and dmin lead the block
            raw[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            raw[..., 2:4] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        else:  # Q6_K: d ends the block
            raw[..., -2:] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    else:  # Q8_0: an f16 scale, then 32 int8
        raw[..., 0:2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(*lead, cols // per_block * block_bytes)


BlockWriter = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def write_tensors(
    writer: GGUFWriter,
    path: Path,
    tensors: Tensors,
    seed: int,
    blocks: dict[T, BlockWriter] | None = None,
) -> None:
    """Every tensor, then the file: `blocks` writes the block types `random_blocks` does not
    know (gpt-oss's MXFP4)."""
    rng = np.random.default_rng(seed)
    blocks = blocks or {}
    for name, shape, qtype in tqdm(tensors, desc=f"writing {path.name}", unit="tensor"):
        if qtype is None:  # norms
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        elif qtype == T.F32:  # biases, sinks, the router
            writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.02)
        elif qtype in blocks:
            writer.add_tensor(name, blocks[qtype](rng, shape), raw_dtype=qtype)
        else:
            writer.add_tensor(name, random_blocks(rng, shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_bytes(tensors: Tensors) -> int:
    """Bytes the tensors take in the file (a norm's ones in F32)."""
    total = 0
    for _, shape, qtype in tensors:
        per_block, block_bytes = GGML_QUANT_SIZES[qtype or T.F32]
        total += int(np.prod(shape)) // per_block * block_bytes
    return total
