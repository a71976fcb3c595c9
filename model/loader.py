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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model.checkpoint import open_checkpoint
from model.checkpoint.base import Checkpoint, Weights
from model.checkpoint.default_model import default_model_path
from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.pypi_models import resolve_model_path
from model.config import ModelConfig
from model.errors import (
    ModelFileError,
    UnsupportedModelError,
)
from model.heap import return_free_heap
from model.network.llama import Llama
from model.parallel.plan import TensorParallel
from model.plan.activation_probe import probe_applies, probe_ids, probed_plan
from model.plan.build import CheckpointFacts, PlanFlags, build_kernel_plan
from model.plan.kernel_plan import KernelPlan, use_kernels
from model.plan.mode import check_mode
from model.row_invariant import make_rows_invariant
from model.text.chat_template import ChatTemplate
from model.text.llama3_chat import llama3_chat_format
from model.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
TRIM_BYTES = 16 << 20


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
    cpu_kernels: str = "auto",
) -> LoadedModel:
    """quantization: None keeps every weight in `dtype`; "int8", "int4" or "w4a8" quantises the
    decoder's linear layers as they load (model/quant/). dtype "auto" or
    quantization "auto" choose by timing this machine (model/plan/weight_format.py), except
    under tensor parallelism (`tp`: this rank's shard only), where every rank must pick
    the same format without talking: float32 on a CPU, bfloat16 on CUDA, unquantised.
    cpu_kernels: the kernel plan's mode (model/plan/mode.py). The plan is built first,
    from the checkpoint's description and the flags, then the model in its formats."""
    started = time.perf_counter()
    check_mode(cpu_kernels)
    path = resolve_model_path(path) if path is not None else default_model_path()
    checkpoint = open_checkpoint(path)
    config, name = checkpoint.config, checkpoint.name
    tokenizer = checkpoint.tokenizer()
    template = checkpoint.chat_template(tokenizer)
    if template is None:
        # Llama 3 checkpoints without a Jinja template still chat the way Meta formats it.
        template = llama3_chat_format(tokenizer)

    if tp is not None:
        tp.check(config)
        dtype, quantization = tp.same_format_on_every_rank(dtype, quantization, device)
    flags = PlanFlags(
        dtype,
        quantization,
        batch_invariant,
        attention_backend,
        cpu_kernels,
        quantized_head=tp is None,
        tensor_parallel=tp is not None,
        facts=checkpoint_facts(checkpoint),
    )
    plan = build_kernel_plan(config, device, flags)
    model = _load_weights(checkpoint, plan, max_position, tp, progress)
    if probe_applies(plan, quantization):
        # Before the C decoder layers are built: they read each layer's final kernel.
        ids = probe_ids(tokenizer, template, max_position or config.max_position)
        plan = probed_plan(plan, model, ids, path)
    use_kernels(model, plan)
    if batch_invariant:
        make_rows_invariant(model)
    return_free_heap()
    logger.info(
        "loaded %s: %.1fM parameters, %s on %s, %s attention, in %.1f s",
        name,
        config.num_parameters() / 1e6,
        plan.formats(),
        device,
        model.attention.name,
        time.perf_counter() - started,
    )
    return LoadedModel(name, path, config, model, tokenizer, template)


def checkpoint_facts(checkpoint: Checkpoint) -> CheckpointFacts:
    """What the kernel plan needs to know of the checkpoint's weights before reading them."""
    return CheckpointFacts(
        checkpoint.checkpoint_bits,
        checkpoint.wide_linears,
        checkpoint.q5_0_linears,
        checkpoint.q6_k_linears,
        checkpoint.mxfp4_linears,
        checkpoint.head_quantized,
        checkpoint.head_block_type,
        checkpoint.split_qkv_linears,
    )


def _load_weights(
    checkpoint: Checkpoint,
    plan: KernelPlan,
    max_position: int | None,
    tp: TensorParallel | None,
    progress: bool,
) -> Llama:
    """An empty model in the plan's formats, filled from the checkpoint's weights."""
    config, fmt, device = checkpoint.config, plan.weight_format, plan.device
    # On the CPU a quantised embedding stays in the file's blocks, read as rows are looked up.
    cpu = torch.device(device).type == "cpu"
    embedding = checkpoint.packed_embedding(fmt.dtype) if cpu and tp is None else None
    # Quantised layers are filled from the checkpoint's own values, not a rounded copy; on
    # the CPU, from its own blocks where they hold those as they are.
    weights, presharded = checkpoint.weights(
        torch.float32 if fmt.quantization else fmt.dtype,
        tp,
        file_blocks=cpu and fmt.quantization is not None,
    )
    if tp is not None and not presharded:
        weights = tp.shard_weights(weights, config)
    model = Llama.empty(
        config,
        max_position,
        device,
        fmt.dtype,
        fmt.quantization,
        tp=tp,
        head_int8=plan.head is not None,
        head_int6=plan.head in ("int6", "w6a8"),
        head_int8_activations=plan.head in ("w6a8", "w8a8"),
        layer_quantizations=plan.layer_quantizations,
        int4_kernels=plan.int4_kernels,
    )
    if embedding is not None:
        model.embed_tokens = embedding
    bar = tqdm(
        weights,
        total=checkpoint.num_tensors,
        desc="loading weights",
        unit="tensor",
        disable=not progress,
    )
    # Dequantisation is many small ops: one thread is several times faster than two that
    # wait on each other, and far faster when another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.load_weights((n, _to(t, device)) for n, t in _trimming(bar))
    except ValueError as exc:
        if isinstance(exc, ModelFileError | UnsupportedModelError):
            raise
        raise ModelFileError(f"{checkpoint.path}: {exc}") from None
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def resolve_device(name: str) -> str:
    """--device auto: the GPU when torch sees one."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def checkpoint_config(path: str | Path | None) -> ModelConfig | None:
    """The model's shapes, read without its weights or tokenizer, for checks that should
    fail before anything heavy starts; None when `path` is no model (load_model says why)."""
    path = resolve_model_path(path) if path is not None else default_model_path()
    try:
        return open_checkpoint(path).config
    except ModelFileError:
        return None


def _trimming(weights: Iterable[tuple[str, torch.Tensor | FileBlocks]]) -> Weights:
    """The weights, with the C heap's free pages handed back each time tensors of
    `TRIM_BYTES` in all have been taken: their temporaries (dequantised blocks, staging)
    otherwise stay resident in glibc's heap, 60-130 MB at a time on Qwen2.5-0.5B, all of
    it counted in the server's peak memory. Not after every tensor: each trim walks the
    heap, and that took loading from 9 to 12 s."""
    taken = 0
    for name, tensor in weights:
        if taken >= TRIM_BYTES:
            return_free_heap()
            taken = 0
        taken += tensor.nbytes
        yield name, tensor


def _to(weight: torch.Tensor | FileBlocks, device: str) -> torch.Tensor | FileBlocks:
    """File blocks are only handed over on the CPU (`Checkpoint.weights`)."""
    return weight if isinstance(weight, FileBlocks) else weight.to(device)
