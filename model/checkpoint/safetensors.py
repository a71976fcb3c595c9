"""Streams tensors out of an HF safetensors checkpoint (one file, or shards listed in
`model.safetensors.index.json`) under their HF names, in the HF RoPE layout.

It yields tensors one at a time and never holds the whole checkpoint in memory.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from model.errors import ModelFileError


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelFileError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory}: no *.safetensors weights found")
    for file in files:
        if not file.is_file():
            raise ModelFileError(f"{file}: shard listed in the index is missing")
    return files


def _open(file: Path) -> "safe_open":
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors raises its own error type on a bad header
        raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from None


def count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with _open(file) as f:
            total += len(list(f.keys()))
    return total


def iter_safetensors(
    files: list[Path],
    dtype: torch.dtype,
    cut: Callable[[str, Any], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """cut(name, lazy_slice): reads only part of each tensor (a tensor-parallel rank's
    shard), by indexing safetensors' lazy slice, so the rest is never read from disk."""
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                tensor = cut(name, f.get_slice(name)) if cut else f.get_tensor(name)
                # uint8 is an MXFP4 pair's bytes (model/checkpoint/hf_mxfp4.py), kept so.
                yield name, tensor if tensor.dtype == torch.uint8 else tensor.to(dtype)
