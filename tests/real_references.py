"""`transformers` loading a real GGUF, the reference for the real-model tests, kept after
the first time: reading a GGUF through transformers (its dequantisation in numpy) takes
about 30 s per model, reading its own safetensors copy back a second or two.

The copy is transformers' own output (`save_pretrained` of what it loaded), keyed by the
GGUF's pinned name and size, and lives in the model cache, outside the repository."""

from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from model.checkpoint.pypi_models import model_cache


def _copy_dir(gguf: Path, kind: str) -> Path:
    return model_cache() / "transformers" / f"{gguf.stem}-{gguf.stat().st_size}-{kind}"


def hf_model_of(gguf: Path) -> PreTrainedModel:
    """transformers' float32 model of `gguf`."""
    copy = _copy_dir(gguf, "float32")
    if (copy / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    # transformers will not `save_pretrained` a model it read from a GGUF; its weights and
    # config are plain, so they are written as the directory that method would write.
    copy.mkdir(parents=True, exist_ok=True)
    save_model(model, str(copy / "model.safetensors"))
    model.config.save_pretrained(copy)
    return model


def hf_tokenizer_of(gguf: Path):
    """transformers' tokenizer of `gguf`."""
    copy = _copy_dir(gguf, "tokenizer")
    if not (copy / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(copy)
    # The generic class reads tokenizer.json exactly as built from the GGUF; the model's own
    # class would add what its own tokenizer.json has (Qwen2's NFC normaliser), which the
    # GGUF and llama.cpp do not.
    return PreTrainedTokenizerFast.from_pretrained(copy)
