"""Loads a checkpoint (GGUF file, HF safetensors directory or Meta `params.json` directory)
into a ready `Llama` plus its tokenizer and chat template; or builds a model of a named shape
with random weights.

Every way a model path can be wrong ends here as one `ModelFileError` or
`UnsupportedModelError` sentence naming the file and the problem; callers print it
and exit instead of showing a traceback.

It never keeps a second copy of the weights and never touches the KV cache or requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model.attention import attention_backend
from model.attention.base import AttentionBackend
from model.config import ModelConfig
from model.errors import (
    ModelFileError,
    TokenizerError,
    UnsupportedFormatError,
    UnsupportedModelError,
)
from model.families import FAMILIES
from model.heap import return_free_heap
from model.llama import Llama
from model.native.ops import NativeRmsNorm
from model.parallel.plan import TensorParallel
from model.text.chat_template import ChatTemplate
from model.text.llama3_chat import llama3_chat_format
from model.text.llama3_tokenizer import llama3_tokenizer
from model.text.tokenizer import Tokenizer
from model.text.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir
from model.weight_format import WeightFormat, choose_head_int8, resolve_weight_format
from model.weights.default_model import DEFAULT_MODEL_NAME, default_model_path
from model.weights.gguf import (
    check_tensor_types,
    count_gguf_tensors,
    iter_gguf_weights,
    linear_weight_bits,
    output_exact_in_int8,
)
from model.weights.gguf_file import open_gguf
from model.weights.meta import (
    count_meta_tensors,
    files_match_ranks,
    iter_meta_rank_weights,
    iter_meta_weights,
    open_meta_checkpoint,
)
from model.weights.pypi_models import resolve_model_path
from model.weights.safetensors import count_tensors, iter_safetensors, safetensors_files

logger = logging.getLogger(__name__)


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
    dtype: torch.dtype | str = torch.float32,
    max_position: int | None = None,
    progress: bool = True,
    quantization: str | None = None,
    batch_invariant: bool = False,
    attention_backend: str = "auto",
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """quantization: None keeps every weight in `dtype`; "int8", "int4" or "w4a8" quantises the
    decoder's linear layers as they load (model/quantized_linear.py). dtype "auto" or
    quantization "auto" choose by timing this machine (model/weight_format.py), except
    under tensor parallelism (`tp`: this rank's shard only), where every rank must pick
    the same format without talking: float32 on a CPU, bfloat16 on CUDA, unquantised."""
    started = time.perf_counter()
    path = resolve_model_path(path) if path is not None else default_model_path()
    presharded = False  # weights read as this rank's shards already
    head_exact_in_int8 = False  # the output weight is stored in a type int8 holds exactly
    if path.is_dir() and (path / "config.json").is_file():
        config = ModelConfig.from_hf_dir(path)
        files = safetensors_files(path)
        total = count_tensors(files)
        read_weights: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]] = partial(
            iter_safetensors, files
        )
        if tp is not None:  # each rank reads only its own slices from disk
            read_weights = partial(iter_safetensors, files, cut=tp.cut(config))
            presharded = True
        read_weights = partial(_adapted, read_weights, FAMILIES[config.architecture].adapt_hf)
        checkpoint_bits = None
        tokenizer = _named(path, tokenizer_from_hf_dir, path)
        template = ChatTemplate.from_hf_dir(path, tokenizer)
        name = path.name
    elif path.is_dir() and (path / "params.json").is_file():
        checkpoint = open_meta_checkpoint(path)
        params_file = str(path / "params.json")
        config = ModelConfig.from_meta_params(
            checkpoint.params, checkpoint.tensor_names, source=params_file
        )
        total = count_meta_tensors(checkpoint)
        read_weights = partial(iter_meta_weights, checkpoint, config)
        if tp is not None and files_match_ranks(checkpoint, config, tp.size):
            read_weights = partial(iter_meta_rank_weights, checkpoint, config, tp.rank)
            presharded = True
        checkpoint_bits = None
        tokenizer = _meta_tokenizer(path, config)
        template = None
        name = path.name
    elif path.is_dir():
        raise ModelFileError(
            f"{path}: directory has neither config.json (HF checkpoint) "
            "nor params.json (Meta checkpoint)"
        )
    elif path.is_file() and path.suffix == ".gguf":
        gguf = open_gguf(path)
        check_tensor_types(gguf)
        names = {t.name for t in gguf.tensors}
        config = ModelConfig.from_gguf_metadata(gguf.metadata, names, source=str(path))
        total = count_gguf_tensors(gguf)
        read_weights = partial(iter_gguf_weights, gguf, config)
        checkpoint_bits = linear_weight_bits(gguf)
        head_exact_in_int8 = output_exact_in_int8(gguf)
        tokenizer = _named(path, tokenizer_from_gguf, gguf.metadata)
        template = ChatTemplate.from_gguf_metadata(gguf.metadata, tokenizer)
        name = DEFAULT_MODEL_NAME if path == default_model_path_or_none() else path.stem
    elif path.exists():
        raise ModelFileError(
            f"{path}: not a model (expected a .gguf file, an HF or a Meta checkpoint directory)"
        )
    else:
        raise ModelFileError(f"{path}: no such file or directory")
    if template is None:
        # Llama 3 checkpoints without a Jinja template still chat the way Meta formats it.
        template = llama3_chat_format(tokenizer)

    if tp is not None:
        tp.check(config)
        dtype, quantization = tp.same_format_on_every_rank(dtype, quantization, device)
    fmt = weight_format_for(dtype, quantization, config, device, checkpoint_bits, batch_invariant)
    head_int8 = tp is None and choose_head_int8(
        config, fmt, head_exact_in_int8, torch.device(device)
    )
    # Quantised layers are filled from the checkpoint's own values, not a rounded copy.
    weights = read_weights(torch.float32 if fmt.quantization else fmt.dtype)
    if tp is not None and not presharded:
        weights = tp.shard_weights(weights, config)
    model = Llama.empty(
        config, max_position, device, fmt.dtype, fmt.quantization, tp=tp, head_int8=head_int8
    )
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
    use_kernels(model, attention_backend, device)
    return_free_heap()
    logger.info(
        "loaded %s: %.1fM parameters, %s on %s, %s attention, in %.1f s",
        name,
        config.num_parameters() / 1e6,
        fmt.describe() + (" (output projection int8)" if head_int8 else ""),
        device,
        model.attention.name,
        time.perf_counter() - started,
    )
    return LoadedModel(name, path, config, model, tokenizer, template)


def weight_format_for(
    dtype: torch.dtype | str,
    quantization: str | None,
    config: ModelConfig,
    device: str,
    checkpoint_bits: int | None,
    batch_invariant: bool = False,
) -> WeightFormat:
    if isinstance(dtype, torch.dtype) and quantization != "auto" and not batch_invariant:
        return WeightFormat(dtype, quantization)
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return resolve_weight_format(
        config,
        torch.device(device),
        dtype_name,
        quantization or "none",
        checkpoint_bits,
        batch_invariant,
    )


def _adapted(
    read: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]],
    adapt: Callable[[str, torch.Tensor], tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF checkpoint's tensors as its family names and stores them for us."""
    return (adapt(name, tensor) for name, tensor in read(dtype))


def _named(path: Path, read: Callable[[Any], Tokenizer], source: Any) -> Tokenizer:
    """A tokenizer we cannot reproduce is one sentence naming the file, as all else is."""
    try:
        return read(source)
    except TokenizerError as exc:
        raise ModelFileError(f"{path}: {exc}") from None


def resolve_device(name: str) -> str:
    """--device auto: the GPU when torch sees one."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def checkpoint_config(path: str | Path | None) -> ModelConfig | None:
    """The model's shapes, read without its weights or tokenizer, for checks that should
    fail before anything heavy starts; None when `path` is no model (load_model says why)."""
    path = resolve_model_path(path) if path is not None else default_model_path()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf_dir(path)
    if path.is_dir() and (path / "params.json").is_file():
        checkpoint = open_meta_checkpoint(path)
        return ModelConfig.from_meta_params(
            checkpoint.params, checkpoint.tensor_names, source=str(path / "params.json")
        )
    if path.is_file() and path.suffix == ".gguf":
        gguf = open_gguf(path)
        names = {t.name for t in gguf.tensors}
        return ModelConfig.from_gguf_metadata(gguf.metadata, names, source=str(path))
    return None


def use_kernels(model: Llama, attention_backend: str, device: str) -> None:
    """The attention backend, and with the CPU's C attention the C RMSNorm and decoder
    layers too: all come from one library, and `--attention-backend torch_ref` keeps the
    whole forward in plain PyTorch, the reference."""
    model.attention = _attention_backend(attention_backend, device)
    if model.attention.name == "cpu_paged":
        model.use_native_norm(NativeRmsNorm())
        model.use_native_layers()


def _attention_backend(name: str, device: str) -> AttentionBackend:
    try:
        return attention_backend(name, device)
    except ValueError as exc:
        raise UnsupportedFormatError(str(exc)) from None


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except RuntimeError:
        return None


def read_llama3_tokenizer(file: Path) -> Tokenizer:
    try:
        return llama3_tokenizer(file)
    except TokenizerError as exc:  # its message already names the file
        raise ModelFileError(str(exc)) from None


def _meta_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    file = path / "tokenizer.model"
    if not file.is_file():
        raise ModelFileError(f"{path}: Meta checkpoint has no tokenizer.model")
    tokenizer = read_llama3_tokenizer(file)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFileError(
            f"{file}: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
            f"{config.vocab_size}"
        )
    return tokenizer
