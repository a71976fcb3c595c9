"""LoRA adapters served beside one base model, never merged into it: reading PEFT
directories and GGUF LoRA files (`read_adapter`), checking them against the base, the
resident table of stacked A/B (`LoraSlots`) and the hooks that apply it per step."""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.lora.adapter import AdapterError, LoraAdapter, check_fits
from model.lora.gguf_lora import read_gguf_lora
from model.lora.peft_dir import read_peft_dir


def read_adapter(
    name: str, path: str | Path, config: ModelConfig, max_rank: int | None = None
) -> LoraAdapter:
    """A PEFT directory or a GGUF LoRA file, checked against the base's `config`."""
    path = Path(path)
    if path.is_dir():
        adapter = read_peft_dir(name, path)
    elif path.is_file():
        adapter = read_gguf_lora(name, path, config)
    else:
        raise AdapterError(f"LoRA adapter {name!r}: {path} is neither a directory nor a file")
    check_fits(adapter, config, max_rank)
    return adapter


__all__ = ["AdapterError", "LoraAdapter", "read_adapter"]
