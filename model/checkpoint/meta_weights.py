"""Streams a Meta checkpoint (`params.json` beside `consolidated.NN.pth`, one file per
model-parallel rank) as HF-named tensors in the HF RoPE layout.

Meta's code rotates interleaved pairs, so the rows of wq and wk are permuted into halves here,
as GGUF's are (wk with n_kv_heads). Each rank's file holds a slice of every matrix, cut where
fairscale cuts it, and the slices are concatenated back. A `.pth` file is a pickle: it is only
ever opened with `weights_only=True`, which refuses anything but tensors, and memory-mapped so
that loading streams tensor by tensor instead of reading every shard into memory first.
"""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.checkpoint.gguf_weights import interleaved_to_halves
from model.config import ModelConfig
from model.errors import ModelFileError, UnsupportedModelError

# Meta name -> (HF name, dimension the model-parallel ranks split; None: replicated).
_GLOBAL_NAMES = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", 0),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", 0),
}
_LAYER_NAMES = {
    "attention_norm": ("input_layernorm", None),
    "attention.wq": ("self_attn.q_proj", 0),
    "attention.wk": ("self_attn.k_proj", 0),
    "attention.wv": ("self_attn.v_proj", 0),
    "attention.wo": ("self_attn.o_proj", 1),
    "ffn_norm": ("post_attention_layernorm", None),
    "feed_forward.w1": ("mlp.gate_proj", 0),
    "feed_forward.w2": ("mlp.down_proj", 1),
    "feed_forward.w3": ("mlp.up_proj", 0),
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight")
# Llama 2 checkpoints store their RoPE table; it is recomputed, never loaded.
_IGNORED = {"rope.freqs"}


@dataclass
class MetaCheckpoint:
    path: Path
    params: dict[str, Any]
    shards: list[dict[str, torch.Tensor]]

    @property
    def tensor_names(self) -> set[str]:
        return set(self.shards[0]) - _IGNORED


def hf_name(meta_name: str) -> tuple[str, int | None] | None:
    if meta_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[meta_name]
    m = _LAYER_RE.fullmatch(meta_name)
    if m and m.group(2) in _LAYER_NAMES:
        name, split_dim = _LAYER_NAMES[m.group(2)]
        return f"model.layers.{m.group(1)}.{name}.weight", split_dim
    return None


def open_meta_checkpoint(directory: Path) -> MetaCheckpoint:
    params_file = directory / "params.json"
    try:
        params = json.loads(params_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{params_file}: cannot read Meta params ({exc})") from None
    files = sorted(directory.glob("consolidated.*.pth"))
    if not files:
        raise ModelFileError(f"{directory}: params.json but no consolidated.*.pth weights")
    shards = []
    for file in files:
        try:
            shards.append(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
        except Exception as exc:  # torch raises pickle, zip and runtime errors alike
            raise ModelFileError(f"{file}: not a readable PyTorch checkpoint ({exc})") from None
    for file, shard in zip(files, shards, strict=True):
        if not isinstance(shard, dict) or set(shard) != set(shards[0]):
            raise ModelFileError(f"{file}: holds other tensors than {files[0].name}")
    return MetaCheckpoint(directory, params, shards)


def count_meta_tensors(checkpoint: MetaCheckpoint) -> int:
    return len(checkpoint.tensor_names)


def iter_meta_weights(
    checkpoint: MetaCheckpoint, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    ranks = len(checkpoint.shards)
    if config.n_kv_heads % ranks:
        raise UnsupportedModelError(
            f"{checkpoint.path}: {config.n_kv_heads} KV heads cannot be split over {ranks} "
            "model-parallel files"
        )
    for meta_name in checkpoint.shards[0]:
        if meta_name in _IGNORED:
            continue
        target = hf_name(meta_name)
        if target is None:
            raise ModelFileError(f"{checkpoint.path}: unexpected tensor {meta_name!r}")
        name, split_dim = target
        pieces = [shard[meta_name] for shard in checkpoint.shards]
        if split_dim is None or ranks == 1:
            weight = pieces[0].to(dtype)
        else:
            weight = torch.cat([p.to(dtype) for p in pieces], dim=split_dim)
        # Each rank holds whole heads, so the concatenated rows are the full matrix in Meta's
        # layout and can be permuted head by head.
        if meta_name.endswith("attention.wq.weight"):
            weight = interleaved_to_halves(weight.contiguous(), config.n_heads)
        elif meta_name.endswith("attention.wk.weight"):
            weight = interleaved_to_halves(weight.contiguous(), config.n_kv_heads)
        yield name, weight


def files_match_ranks(checkpoint: MetaCheckpoint, config: ModelConfig, size: int) -> bool:
    """Meta's per-rank files map straight onto tensor-parallel ranks when there are as many,
    and each rank holds whole KV heads and an even share of the vocabulary."""
    return (
        len(checkpoint.shards) == size
        and config.n_kv_heads % size == 0
        and config.vocab_size % size == 0
    )


def iter_meta_rank_weights(
    checkpoint: MetaCheckpoint, config: ModelConfig, rank: int, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor-parallel rank `rank` of as many ranks as the checkpoint has files: Meta cut
    every matrix where llamaserve's ranks cut it (whole heads, FFN rows and columns,
    vocabulary rows), so the rank's tensors are its own file's, and no other file is read."""
    ranks = len(checkpoint.shards)
    shard = checkpoint.shards[rank]
    for meta_name, piece in shard.items():
        if meta_name in _IGNORED:
            continue
        target = hf_name(meta_name)
        if target is None:
            raise ModelFileError(f"{checkpoint.path}: unexpected tensor {meta_name!r}")
        weight = piece.to(dtype)
        if meta_name.endswith("attention.wq.weight"):
            weight = interleaved_to_halves(weight.contiguous(), config.n_heads // ranks)
        elif meta_name.endswith("attention.wk.weight"):
            weight = interleaved_to_halves(weight.contiguous(), config.n_kv_heads // ranks)
        yield target[0], weight
