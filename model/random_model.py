"""A model of a named published shape (`model.presets`) with random weights: memory,
KV-cache capacity and speed at that scale without its checkpoint."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from model.checkpoint.meta import read_llama3_tokenizer
from model.config import ModelConfig
from model.errors import ModelFileError
from model.loader import LoadedModel
from model.network.llama import Int4Kernels, Llama
from model.parallel.plan import TensorParallel
from model.plan.build import PlanFlags, build_kernel_plan
from model.plan.kernel_plan import use_kernels
from model.plan.mode import check_mode
from model.presets import preset_config
from model.row_invariant import make_rows_invariant
from model.text.llama3_chat import llama3_chat_format
from model.text.llama3_tokenizer import bundled_tokenizer_path, llama3_byte_tokenizer

logger = logging.getLogger(__name__)


def load_random_model(
    preset: str,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
    max_position: int | None = None,
    quantization: str | None = None,
    batch_invariant: bool = False,
    attention_backend: str = "auto",
    tp: TensorParallel | None = None,
    cpu_kernels: str = "auto",
) -> LoadedModel:
    """A model of a named published shape (`model.presets`) with random weights, to exercise
    memory, KV-cache capacity and speed at that scale without its checkpoint.

    The tokenizer is Meta's Llama 3 `tokenizer.model` from `tokenizer_path`, else the copy
    inside the `llama-models` package when that is installed, else a byte-level stand-in with
    Llama 3's special tokens (`llama3_byte_tokenizer`). The chat format is Llama 3's."""
    started = time.perf_counter()
    check_mode(cpu_kernels)
    config = preset_config(preset)
    path = Path(tokenizer_path) if tokenizer_path is not None else bundled_tokenizer_path()
    tokenizer = read_llama3_tokenizer(path) if path is not None else llama3_byte_tokenizer()
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFileError(
            f"{path}: {tokenizer.vocab_size} tokens do not fit {preset}'s vocabulary of "
            f"{config.vocab_size}"
        )
    if tp is not None:  # each rank draws its own shard's weights, seeded by its rank
        tp.check(config)
        dtype, quantization = tp.same_format_on_every_rank(dtype, quantization, device)
        seed += tp.rank
    flags = PlanFlags(
        dtype, quantization, batch_invariant, attention_backend, cpu_kernels, quantized_head=False
    )
    plan = build_kernel_plan(config, device, flags)
    fmt = plan.weight_format
    model = random_llama(
        config,
        max_position,
        device,
        fmt.dtype,
        seed,
        quantization=fmt.quantization,
        tp=tp,
        int4_kernels=plan.int4_kernels,
    )
    use_kernels(model, plan)
    if batch_invariant:
        make_rows_invariant(model)
    logger.info(
        "built %s with random weights: %.1fM parameters, %s on %s, %s attention, in %.1f s "
        "(tokenizer: %s)",
        preset,
        config.num_parameters() / 1e6,
        fmt.describe(),
        device,
        model.attention.name,
        time.perf_counter() - started,
        path or "byte-level stand-in",
    )
    template = llama3_chat_format(tokenizer)
    return LoadedModel(f"{preset}-random", Path(preset), config, model, tokenizer, template)


@torch.no_grad()
def random_llama(
    config: ModelConfig,
    max_position: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    quantization: str | None = None,
    tp: TensorParallel | None = None,
    int4_kernels: Int4Kernels | None = None,
) -> Llama:
    """A model with seeded random weights (matrices N(0, std), norm gains 1), drawn on
    `device` itself: PyTorch's default init on the CPU takes minutes at 8B parameters."""
    model = Llama.empty(
        config, max_position, device, dtype, quantization, tp, int4_kernels=int4_kernels
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():  # a tied weight is listed once
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    for module in model.quantized_modules().values():
        shape = (module.out_features, module.in_features)
        weight = torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
        module.load_rows(0, weight)
    return model.eval()
