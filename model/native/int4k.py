"""The int4 kernels on the superblock layout of their scales (int4_scales.h,
int4k_matmul.c): a Q4_K file's int4 layers held exactly, at 4.625 bits a weight where the
plain layout takes 5. A one-row decode streams every weight byte from memory, so the
smaller scales are that much less to read (50 MB a step for a 1.5B Q4_K_M model).

Where it pays (`superblocks_pay`), measured on the 2-core AVX-512 EPYC with
Qwen2.5-Coder-1.5B Q4_K_M, medians of six alternating runs in one process: with VNNI's
int8-activation loop a decode step took 31.4 ms against 32.3 while the machine's memory was
slow, 25.8 against 25.4 while it was fast; 128-row products 2% slower. The AVX2 loops spend
more on a group's scales (sub-scales spread to even and odd columns): a step 48.6 against
48.7 ms, 128-row products 7% slower, so there it is not taken."""

from __future__ import annotations

from functools import cache

import torch

from model.native.build import NativeUnavailable
from model.native.huge_pages import empty_on_huge_pages
from model.native.ops import _TiledMatmul, native_int4_matmul

SUPERBLOCK = 256  # values along K under one d and dmin: Q4_K's block
TILE = 16


class NativeInt4KMatmul(_TiledMatmul):
    """int4 with bf16 activations (int4_matmul.c's loops) on the superblock layout."""

    symbol, out_dtype = "int4k_matmul", torch.bfloat16


class NativeInt4KA8Matmul(_TiledMatmul):
    """int4 with int8 activations (int4_matmul_a8.c's loops) on the superblock layout."""

    symbol, out_dtype = "int4k_matmul_a8", torch.bfloat16


@cache
def superblocks_pay() -> bool:
    """Whether Q4_K layers take the superblock layout with this build: where its
    int8-activation loop is AVX-512 VNNI's."""
    try:
        return NativeInt4KA8Matmul().kind == "avx512_vnni"
    except NativeUnavailable:
        return False


def int4_matmul_for(kernel: str, superblocks: bool) -> _TiledMatmul:
    """The C int4 matmul for an Int4Linear kernel ("native" or "native_a8") and layout."""
    if not superblocks:
        return native_int4_matmul(kernel)
    return NativeInt4KA8Matmul() if kernel == "native_a8" else NativeInt4KMatmul()


def superblock_scales(
    d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """The kernels' scale bytes from Q4_K's fields: d, dmin float16 [out, in / 256]; sc, m
    uint8 [out, in / 32] (w = d sc q - dmin m). Per tile of 16 columns and superblock: the
    16 d, the 16 dmin, then per group the 16 sc and the 16 m (int4_scales.h)."""
    out_features, supers = d.shape
    tiles = out_features // TILE
    head = torch.stack([d, dmin], dim=-1).reshape(tiles, TILE, supers, 2)
    head = head.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(tiles, supers, 64)
    body = torch.stack([sc, m], dim=-1).reshape(tiles, TILE, supers, 8, 2)
    body = body.permute(0, 2, 3, 4, 1).reshape(tiles, supers, 8 * 2 * TILE)
    packed = empty_on_huge_pages((tiles * supers * (64 + 8 * 2 * TILE),), torch.uint8, "cpu")
    packed.view(tiles, supers, -1).copy_(torch.cat([head, body], dim=-1))
    return packed
