"""GGUF Q6_K blocks for tests, which the `gguf` package dequantises but cannot write: random
blocks (every byte string is a valid block), and float weights rounded to blocks the
simple way (a scale per sub-block of 16 from its largest magnitude, without llama.cpp's
search). Either way the weights a test compares against are the `gguf` package's own
dequantisation of the bytes, never these functions' arithmetic."""

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

BLOCK, BLOCK_BYTES = 256, 210  # ql[128], qh[64], int8 scales[16], fp16 d


def random_blocks(n_blocks: int, seed: int = 0, d_scale: float = 1e-3) -> np.ndarray:
    """[n_blocks, 210] random Q6_K blocks, d of either sign below `d_scale`."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, BLOCK_BYTES), dtype=np.uint8)
    d = (rng.random(n_blocks) * 2 - 1) * d_scale
    blocks[:, 208:] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_weight(out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[out, in] fp32: random Q6_K blocks as the `gguf` package dequantises them."""
    blocks = random_blocks(out_features * in_features // BLOCK, seed)
    return dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(out_features, in_features)


def quantize(weight: np.ndarray) -> np.ndarray:
    """weight [..., k] (k % 256 == 0) as Q6_K blocks [..., k / 256 * 210], the byte order
    of llama.cpp's dequantize_row_q6_K."""
    x = weight.reshape(-1, BLOCK).astype(np.float32)
    n = len(x)
    sub = x.reshape(n, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d = (step.max(axis=-1) / 127).astype(np.float16)
    safe_d = np.where(d == 0, 1, d).astype(np.float32)
    scales = np.clip(np.rint(step / safe_d[:, None]), 1, 127).astype(np.int8)
    unit = safe_d[:, None, None] * scales[..., None]
    q = (np.clip(np.rint(sub / unit), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # Per half of 128: ql[l] holds q[l] (low) and q[l + 64] (high nibble), ql[l + 32] q[l +
    # 32] and q[l + 96]; qh[l] the top bits of q[l], q[l + 32], q[l + 64], q[l + 96].
    ql = np.concatenate(
        [(q[:, :, 0] & 15) | (q[:, :, 2] & 15) << 4, (q[:, :, 1] & 15) | (q[:, :, 3] & 15) << 4],
        axis=-1,
    )
    qh = sum((q[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    blocks = np.concatenate(
        [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            scales.view(np.uint8),
            d.reshape(n, 1).view(np.uint8),
        ],
        axis=-1,
    )
    return blocks.reshape(*weight.shape[:-1], -1)
