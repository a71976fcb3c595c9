"""The MXFP4 block (OCP microscaling: 32 four-bit E2M1 values sharing one E8M0 scale) as
the two checkpoint formats store it, and its dequantisation for the PyTorch reference.

GGUF (type 39, ggml's block_mxfp4) is 17 bytes a block: the scale byte e, then 16 bytes
whose byte j holds element j in its low nibble and element j + 16 in its high one. ggml
keeps the E2M1 values doubled as whole numbers (0, 1, 2, 3, 4, 6, 8, 12 and their
negatives) and halves the scale instead, 2^(e - 128), so every product is exact and e =
255 stays finite. The HF checkpoint (gpt-oss's `*_blocks` [..., rows, blocks, 16] and
`*_scales` [..., rows, blocks]) holds the same scale byte, 2^(e - 127), but its byte j
holds elements 2j (low nibble) and 2j + 1 (high). Our one layout is GGUF's: HF blocks are
reordered into it at load (`hf_to_gguf_blocks`), a shuffle of nibbles, nothing rounded.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values a block
BLOCK_BYTES = 17  # the scale byte and 16 bytes of nibbles
# ggml's kvalues_mxfp4: the E2M1 values doubled, indexed by the nibble (bit 3 the sign).
DOUBLED_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def half_scales(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) for E8M0 bytes e, exactly (subnormal below e = 2), in float32: the
    scale of the doubled values, as ggml_e8m0_to_fp32_half builds it."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(torch.float32)


def decode_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 17] GGUF bytes -> [n_blocks, 32] float32 values, as ggml's
    dequantize_row_mxfp4 gives them (bit for bit)."""
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32, device=blocks.device)
    qs = blocks[:, 1:].to(torch.int64)
    nibbles = torch.cat([qs & 15, qs >> 4], dim=1)  # elements 0..15, then 16..31
    return table[nibbles].mul_(half_scales(blocks[:, :1]))


def dequantize_rows(raw: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width / 32 * 17] GGUF bytes -> [rows, width] float32."""
    return decode_blocks(raw.reshape(-1, BLOCK_BYTES)).reshape(-1, width)


def hf_to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF `*_blocks` [..., rows, n_blocks, 16] and `*_scales` [..., rows, n_blocks] (uint8)
    -> GGUF bytes [..., rows, n_blocks * 17]: the same values in GGUF's nibble order."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    blocks = blocks.to(torch.uint8)
    # Element 2j is byte j's low nibble, 2j + 1 its high one: interleaved back to order.
    values = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., 32]
    packed = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)
    joined = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)
    return joined.flatten(-2)


def quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """[rows, width] floats -> GGUF MXFP4 bytes [rows, width / 32 * 17], as the gguf
    package's quantiser chooses: e = floor(log2(max |w|)) - 2 (so the largest value lands
    near 4 to 8 steps) and each value's nearest doubled E2M1 value. Values that came from
    MXFP4 blocks come back to the same blocks (a layer given dequantised rows, a
    tensor-parallel slice, loses nothing)."""
    rows, width = weight.shape
    groups = weight.to(torch.float32).reshape(-1, BLOCK)
    top = groups.abs().amax(dim=1, keepdim=True)
    exponent = torch.floor(torch.log2(top)) - 2 + 127
    e = torch.where(top > 0, exponent, torch.zeros_like(top)).clamp(0, 254).to(torch.uint8)
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32, device=weight.device)
    candidates = half_scales(e).unsqueeze(-1) * table  # [n, 1, 16]
    nearest = (groups.unsqueeze(-1) - candidates).abs().argmin(dim=-1).to(torch.uint8)
    packed = nearest[:, : BLOCK // 2] | (nearest[:, BLOCK // 2 :] << 4)
    return torch.cat([e, packed], dim=1).reshape(rows, width // BLOCK * BLOCK_BYTES)
