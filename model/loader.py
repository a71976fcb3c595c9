"""Loads a checkpoint (GGUF file or HF safetensors directory) into a ready `Llama`
plus its tokenizer and chat template.

Every way a model path can be wrong ends here as one `ModelFileError` or
`UnsupportedModelError` sentence naming the file and the problem; callers print it
and exit instead of showing a traceback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model.chat_template import ChatTemplate
from model.config import ModelConfig, UnsupportedModelError
from model.default_model import DEFAULT_MODEL_NAME, default_model_path
from model.llama import Llama
from model.tokenizer import Tokenizer
from model.weights.gguf import check_tensor_types, count_gguf_tensors, iter_gguf_weights
from model.weights.gguf_file import ModelFileError, open_gguf
from model.weights.safetensors import count_tensors, iter_safetensors, safetensors_files

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "ModelFileError", "UnsupportedModelError", "load_model"]


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Llama
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


def load_model(
    path: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_position: int | None = None,
    progress: bool = True,
) -> LoadedModel:
    started = time.perf_counter()
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path}: directory has no config.json (HF checkpoint expected)")
        config = ModelConfig.from_hf_dir(path)
        files = safetensors_files(path)
        total = count_tensors(files)
        weights: Iterator[tuple[str, torch.Tensor]] = iter_safetensors(files, dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
        template = ChatTemplate.from_hf_dir(path, tokenizer)
        name = path.name
    elif path.is_file() and path.suffix == ".gguf":
        gguf = open_gguf(path)
        check_tensor_types(gguf)
        names = {t.name for t in gguf.reader.tensors}
        config = ModelConfig.from_gguf_metadata(gguf.metadata, names, source=str(path))
        total = count_gguf_tensors(gguf)
        weights = iter_gguf_weights(gguf, config, dtype)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        template = ChatTemplate.from_gguf_metadata(gguf.metadata, tokenizer)
        name = DEFAULT_MODEL_NAME if path == default_model_path_or_none() else path.stem
    elif path.exists():
        raise ModelFileError(f"{path}: not a model (expected a .gguf file or an HF directory)")
    else:
        raise ModelFileError(f"{path}: no such file or directory")

    model = Llama.empty(config, max_position, device, dtype)
    bar = tqdm(weights, total=total, desc="loading weights", unit="tensor", disable=not progress)
    # Dequantisation is many small ops: one thread is several times faster than two that
    # wait on each other, and far faster when another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.load_weights((n, t.to(device)) for n, t in bar)
    except ValueError as exc:
        if isinstance(exc, ModelFileError | UnsupportedModelError):
            raise
        raise ModelFileError(f"{path}: {exc}") from None
    finally:
        torch.set_num_threads(threads)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s: %.1fM parameters, %s on %s in %.1f s",
        name,
        params / 1e6,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - started,
    )
    return LoadedModel(name, path, config, model, tokenizer, template)


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except RuntimeError:
        return None
