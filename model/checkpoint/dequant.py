"""Turns the raw bytes of one GGUF tensor into a dense torch tensor.

Owns the byte layouts of the ggml quantisation blocks we support (plain floats, the 32-weight
legacy quants, the 256-weight K-quants; MXFP4's in model/checkpoint/mxfp4.py) and nothing
else: it does not read files, name tensors or permute rows. Every decoder is whole-tensor
torch arithmetic, so it runs on whatever device the bytes are on; it must never loop over
blocks in Python or round-trip through numpy, which would make loading slow and pin it to
the CPU.

Values are computed in float32 with the same operation order as ggml's reference
dequantisation (scale times quant, then add or subtract the offset, never fused), so the
float32 result is bit-identical to it; other dtypes are one rounding of that result.
GGUF data is little-endian, and multi-byte fields are reinterpreted in place, so a
big-endian host would need a byte swap first.
"""

from collections.abc import Callable
from math import prod

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from model.checkpoint.mxfp4 import decode_blocks as _decode_mxfp4

QK_K = 256  # weights per K-quant super-block


class UnsupportedQuantType(ValueError):
    """A tensor whose quantisation type this module cannot decode."""


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` of each block, as float32 [n_blocks, 1]."""
    # .contiguous() because a column slice of [n_blocks, type_size] cannot be
    # reinterpreted as a wider dtype in place when type_size is odd.
    field = blocks[:, offset : offset + 2].contiguous()
    return field.view(torch.float16).to(torch.float32)


def _split_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Unpacks `width`-bit fields: [..., n] bytes -> [..., 8 // width, n], lowest bits first.

    Row i of the result holds bits [i*width, (i+1)*width) of every byte: ggml packs the
    quants of consecutive sub-blocks into the same bytes at increasing shifts.
    """
    # One scalar shift per field on a contiguous copy: on CPU, shifting a strided column
    # slice or broadcasting a tensor of shifts is 2-3x slower.
    packed = packed.contiguous()
    mask = (1 << width) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, width)], dim=-2)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] bytes -> [n_blocks, 32] quants: byte j holds element j and j + 16."""
    return _split_bits(qs, 4).reshape(qs.shape[0], 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 4] bytes (a little-endian uint32) -> [n_blocks, 32] bits, bit j = element j."""
    # _split_bits orders by shift then byte; the uint32 orders by byte then shift.
    return _split_bits(qh, 1).transpose(-1, -2).reshape(qh.shape[0], 32)


# The decoders below turn the quants into exact integer-valued float32 first, then scale in
# place (q * d, then + m or - m): the same roundings as ggml's reference, without a fresh
# full-size buffer per operation.


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = q8_0_grid(blocks)
    return q.to(torch.float32).mul_(d)


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.float32)
    return q.sub_(8).mul_(_f16(blocks, 0))


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return q.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q, d = q5_0_grid(blocks)
    return q.to(torch.float32).sub_(16).mul_(d)


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4)).to(torch.float32)
    return q.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> two float32 [n_blocks, 8, 1].

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 do
    the same for the mins; bytes 8-11 hold the low 4 bits of scale 4-7 (low nibble) and of
    min 4-7 (high nibble). This is ggml's get_scale_min_k4, done for all 8 at once.
    """
    n_blocks = packed.shape[0]
    sc_lo, m_lo, tail = packed.reshape(n_blocks, 3, 4).unbind(1)
    scales = torch.cat((sc_lo & 0x3F, (tail & 0x0F) | ((sc_lo >> 2) & 0x30)), dim=1)
    mins = torch.cat((m_lo & 0x3F, (tail >> 4) | ((m_lo >> 2) & 0x30)), dim=1)
    return scales.to(torch.float32).unsqueeze(-1), mins.to(torch.float32).unsqueeze(-1)


def _decode_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales[16] (4-bit scale | 4-bit min), qs[64], f16 d, f16 dmin
    n_blocks = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_f16(blocks, 80) * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (_f16(blocks, 82) * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    q = _split_bits(blocks[:, 16:80].reshape(n_blocks, 2, 32), 2)
    q = q.reshape(n_blocks, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n_blocks, QK_K)


def _decode_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask[32], qs[64], scales[12] (16 6-bit signed scales), f16 d
    n_blocks = blocks.shape[0]
    # Low 4 bits of the 16 scales sit in bytes 0-7 (nibbles), the high 2 bits in bytes 8-11.
    low = _split_bits(blocks[:, 96:104], 4).reshape(n_blocks, 16)
    high = _split_bits(blocks[:, 104:108], 2).reshape(n_blocks, 16)
    scales = (low | (high << 4)).to(torch.float32) - 32
    dl = (_f16(blocks, 108) * scales).unsqueeze(-1)
    low_q = _split_bits(blocks[:, 32:96].reshape(n_blocks, 2, 32), 2).reshape(n_blocks, 16, 16)
    hmask = _split_bits(blocks[:, :32], 1).reshape(n_blocks, 16, 16)
    # The third bit is stored inverted: a clear hmask bit means "subtract 4".
    q = (low_q | (hmask << 2)).to(torch.float32).sub_(4)
    return q.mul_(dl).reshape(n_blocks, QK_K)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step, low = q4_k_grid(blocks)
    # low is -(dmin m): adding it rounds as ggml's subtraction of dmin m does.
    return q.to(torch.float32).mul_(step).add_(low).reshape(blocks.shape[0], QK_K)


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # f16 d, f16 dmin, scales[12], qh[32], qs[128]; qh bit j of byte l is sub-block j's 5th bit
    n_blocks = blocks.shape[0]
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    dl, ml = _f16(blocks, 0).unsqueeze(-1) * scales, _f16(blocks, 2).unsqueeze(-1) * mins
    low = _split_bits(blocks[:, 48:].reshape(n_blocks, 4, 32), 4).reshape(n_blocks, 8, 32)
    high = _split_bits(blocks[:, 16:48], 1)
    q = (low | (high << 4)).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n_blocks, QK_K)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    q, c, d = q6_k_grid(blocks)
    q = q.to(torch.float32).sub_(32).reshape(n_blocks, 16, 16)
    return q.mul_((d * c.to(torch.float32)).unsqueeze(-1)).reshape(n_blocks, QK_K)


# The grids below are the integers and scales of the block types a quantised layer holds
# as they are (model/checkpoint/file_blocks.py): the decoders above are these times their
# scales.


def q8_0_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = d q: q int8 [n_blocks, 32], d float16 [n_blocks, 1]."""
    return blocks[:, 2:].view(torch.int8), blocks[:, :2].contiguous().view(torch.float16)


def q5_0_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = d (q - 16): q uint8 in 0..31 [n_blocks, 32], d float16 [n_blocks, 1]."""
    q = _nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return q, blocks[:, :2].contiguous().view(torch.float16)


def q4_grid(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, ...]:
    """w = step q + low for Q4_0, Q4_1 and Q4_K: q uint8 in 0..15 [n_blocks, groups, 32],
    step and low float32 [n_blocks, groups, 1] (a group of 32 per block, 8 per Q4_K
    block), each as ggml's reference rounds it."""
    if qtype == GGMLQuantizationType.Q4_K:
        return q4_k_grid(blocks)
    q = _nibbles(blocks[:, 2:] if qtype == GGMLQuantizationType.Q4_0 else blocks[:, 4:])
    step = _f16(blocks, 0)
    # Q4_0's w = d (q - 8): d q - 8 d is exact in float32 (11 and 4 significant bits).
    low = step * -8.0 if qtype == GGMLQuantizationType.Q4_0 else _f16(blocks, 2)
    return q.unsqueeze(1), step.unsqueeze(1), low.unsqueeze(1)


def q4_k_superblocks(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K's fields as they are: d and dmin float16 [n_blocks], the 6-bit sub-scales and
    sub-mins uint8 [n_blocks, 8] (w = d sc q - dmin m)."""
    # f16 d, f16 dmin, scales[12], qs[128]: 8 sub-blocks of 32, each with a scale and a min
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    d = blocks[:, 0:2].contiguous().view(torch.float16).reshape(-1)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).reshape(-1)
    return d, dmin, scales.squeeze(-1).to(torch.uint8), mins.squeeze(-1).to(torch.uint8)


def q4_k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_blocks = blocks.shape[0]
    d, dmin, scales, mins = q4_k_superblocks(blocks)
    # d sc and dmin m, exact in float32 (11 and 6 significant bits): [n_blocks, 8, 1]
    step = (d.float().unsqueeze(-1) * scales.float()).unsqueeze(-1)
    low = (dmin.float().unsqueeze(-1) * mins.float()).unsqueeze(-1)
    # Each 32-byte chunk holds sub-block 2k in its low nibbles and 2k+1 in its high ones.
    q = _split_bits(blocks[:, 16:].reshape(n_blocks, 4, 32), 4).reshape(n_blocks, 8, 32)
    return q, step, low.neg_()


def q6_k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w = d c (q - 32): q uint8 in 0..63 [n_blocks, 256], c int8 per 16 [n_blocks, 16],
    d float32 [n_blocks, 1]."""
    # ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d
    n_blocks = blocks.shape[0]
    low = _split_bits(blocks[:, :128].reshape(n_blocks, 2, 64), 4).reshape(n_blocks, 8, 32)
    high = _split_bits(blocks[:, 128:192].reshape(n_blocks, 2, 32), 2).reshape(n_blocks, 8, 32)
    c = blocks[:, 192:208].contiguous().view(torch.int8)
    return (low | (high << 4)).reshape(n_blocks, QK_K), c, _f16(blocks, 208)


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _decode_q8_0,
    GGMLQuantizationType.Q4_0: _decode_q4_0,
    GGMLQuantizationType.Q4_1: _decode_q4_1,
    GGMLQuantizationType.Q5_0: _decode_q5_0,
    GGMLQuantizationType.Q5_1: _decode_q5_1,
    GGMLQuantizationType.Q2_K: _decode_q2_k,
    GGMLQuantizationType.Q3_K: _decode_q3_k,
    GGMLQuantizationType.Q4_K: _decode_q4_k,
    GGMLQuantizationType.Q5_K: _decode_q5_k,
    GGMLQuantizationType.Q6_K: _decode_q6_k,
    GGMLQuantizationType.MXFP4: _decode_mxfp4,
}

FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_BLOCK_DECODERS) | frozenset(
    FLOAT_TYPES
)


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decodes one tensor's bytes into a new `dtype` tensor of torch-order `shape`.

    `raw` is the tensor's data as uint8, any shape; `shape` is GGUF's dimension list
    reversed (e.g. [out, in] for a linear weight). The result is on raw's device and never
    shares memory with it.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedQuantType(
            f"cannot dequantize GGUF quantisation type {qtype.name}; supported: {supported}"
        )
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must be a uint8 tensor of the {qtype.name} bytes, got {raw.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = prod(shape)
    # ggml never lets a block straddle two rows, so a row length that is not a whole
    # number of blocks means the shape (or the file) is wrong, even if the bytes add up.
    if shape and shape[-1] % block_size != 0:
        raise ValueError(
            f"{qtype.name} row length {shape[-1]} is not a multiple of its block size {block_size}"
        )
    expected_bytes = n_elements // block_size * type_size
    if raw.numel() != expected_bytes:
        raise ValueError(
            f"{qtype.name} tensor of shape {tuple(shape)} needs {expected_bytes} bytes, "
            f"got {raw.numel()}"
        )

    flat = raw.reshape(-1)
    if qtype in FLOAT_TYPES:
        # Always copy: a same-dtype view would alias `raw`, often a read-only memory map, so
        # a later in-place edit of the weight would crash there or rewrite the caller's bytes.
        return flat.view(FLOAT_TYPES[qtype]).reshape(shape).to(dtype, copy=True)
    return _BLOCK_DECODERS[qtype](flat.reshape(-1, type_size)).reshape(shape).to(dtype)
