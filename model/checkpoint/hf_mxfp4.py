"""An HF checkpoint's MXFP4 tensors (gpt-oss's `quantization_config` {"quant_method":
"mxfp4"}): each weight is a pair, `X_blocks` (uint8 [..., rows, n_blocks, 16]) and
`X_scales` (uint8 [..., rows, n_blocks]), joined here into one `X` in GGUF's MXFP4 blocks
(model/checkpoint/mxfp4.py), handed on as FileBlocks so that an MXFP4 layer holds them as
they are: never expanded to floats. A stacked experts' pair [experts, rows, ...] comes as
one FileBlocks of experts * rows rows, a stack of one matrix an expert
(`FileBlocks.matrix`); naming each expert's is the family's (model/families/)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.mxfp4 import BLOCK, hf_to_gguf_blocks
from model.config import ModelConfig
from model.errors import ModelFileError

_PARTS = ("_blocks", "_scales")


def join_mxfp4_pairs(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """The tensors, each `X_blocks`/`X_scales` pair joined into `X` (rows in GGUF's MXFP4
    blocks) once both have come; others as they are. `dtype`: what the blocks dequantise
    to where they reach no MXFP4 layer."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        part = next((p for p in _PARTS if name.endswith(p)), None)
        if part is None or tensor.dtype != torch.uint8:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        other = waiting.pop(base + ("_scales" if part == "_blocks" else "_blocks"), None)
        if other is None:
            waiting[name] = tensor
            continue
        blocks, scales = (tensor, other) if part == "_blocks" else (other, tensor)
        yield base, _joined(blocks, scales, dtype)
    if waiting:
        raise ModelFileError(f"MXFP4 tensors without their other half: {sorted(waiting)[:3]}")


def _joined(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> FileBlocks:
    """One pair's rows in GGUF's blocks, reordered an expert at a time: the reordering's
    temporaries are a few times its input, so a whole stack's (265 MB of gpt-oss-20b's
    gate/up blocks a layer) would have been the load's peak."""
    rows, n_blocks = blocks.shape[-3], blocks.shape[-2]
    if scales.shape != blocks.shape[:-1]:
        raise ModelFileError(f"MXFP4 blocks {tuple(blocks.shape)} and scales do not match")
    parts = blocks.reshape(-1, rows, n_blocks, 16), scales.reshape(-1, rows, n_blocks)
    raw = torch.empty(parts[0].shape[0], rows, n_blocks * 17, dtype=torch.uint8)
    for i in range(raw.shape[0]):
        raw[i] = hf_to_gguf_blocks(parts[0][i], parts[1][i])
    width = n_blocks * BLOCK
    return FileBlocks(raw.reshape(-1, n_blocks * 17), T.MXFP4, width, dtype, raw.shape[0])


def hf_mxfp4_linears(directory: Path, config: ModelConfig) -> frozenset[str]:
    """Our expert layers ('layers.3.moe.experts.5.down_proj') where config.json says the
    checkpoint stores its experts in MXFP4 (as gpt-oss does: every other layer stays in
    bf16, transformers' `modules_to_not_convert`)."""
    try:
        quantization = json.loads((directory / "config.json").read_text()).get(
            "quantization_config"
        )
    except (OSError, json.JSONDecodeError):
        return frozenset()
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "mxfp4":
        return frozenset()
    return frozenset(
        f"layers.{layer}.moe.experts.{e}.{name}"
        for layer in range(config.n_layers)
        if config.is_sparse(layer)
        for e in range(config.n_experts)
        for name in ("gate_up_proj", "down_proj")
    )
