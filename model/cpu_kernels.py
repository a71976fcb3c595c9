"""The CPU kernel plan: which kernels a forward on the CPU runs, decided here and nowhere
else, and logged in one line when the engine starts.

Its parts: the instruction level the C kernels are built for (`LLAMASERVE_CPU_ISA`,
model/native/build.py); per int4 layer shape, our C kernel (bf16 or int8 activations) or
PyTorch's; the output projection in grouped int8 or the model's dtype; the attention
backend, and with the C attention the C RMSNorm and decoder layers (one library: all of
them or none, so that the C path and the PyTorch reference each stay whole); the C argmax;
and, as the runner measures them, the threads for one-token steps and the step's token
budget (all read off the model and runner for the one log line, `describe`).

`--cpu-kernels` says how: `auto` (the default) times what depends on the CPU (remembered
by model/tuning.py) and takes the C kernels where they win; `native` takes the C kernels
wherever they apply, untimed, and is one sentence where they cannot be built; `torch`
keeps every op in plain PyTorch, the reference the kernels are tested against. The plan
belongs to the process: one server, one plan (a draft model shares its target's).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from model.attention import AttentionBackend, attention_backend
from model.config import ModelConfig
from model.errors import UnsupportedFormatError
from model.int4_kernel import NATIVE_INT4_KERNELS, choose_int4_kernel
from model.native.build import NativeUnavailable, isa
from model.native.ops import NativeArgmax, NativeRmsNorm, native_int4_matmul

logger = logging.getLogger(__name__)

CPU_KERNELS = ("auto", "native", "torch")
# What runs on the C kernels alone: no PyTorch twin serves these formats.
NATIVE_ONLY_QUANTIZATIONS = ("w4a8", "int8g")


_mode = "auto"


def set_mode(mode: str) -> None:
    """The mode for the models this process loads from now on."""
    global _mode
    if mode not in CPU_KERNELS:
        raise UnsupportedFormatError(
            f"--cpu-kernels {mode!r}: choose one of {', '.join(CPU_KERNELS)}"
        )
    if mode == "native":
        _native_or_refuse("--cpu-kernels native")
    _mode = mode


def mode() -> str:
    return _mode


def check_quantization(quantization: str | None) -> None:
    """One sentence for a format only the C kernels run, where the plan keeps them off."""
    if _mode == "torch" and quantization in NATIVE_ONLY_QUANTIZATIONS:
        raise UnsupportedFormatError(
            f"--quantization {quantization} runs on the C kernels; --cpu-kernels torch keeps "
            "them off"
        )


def allows_native() -> bool:
    return _mode != "torch"


def int4_kernel(
    in_features: int, out_features: int, device: torch.device, allowed: tuple[str, ...]
) -> str:
    """The kernel an int4 layer of this shape runs on (int4_kernel.py times them)."""
    if device.type != "cpu":
        return "torch"
    if _mode == "torch":
        if "torch" not in allowed:
            check_quantization("w4a8")
        kernel = "torch"
    elif _mode == "native":  # set_mode checked that the library builds
        kernel = next(k for k in allowed if k in NATIVE_INT4_KERNELS)
    else:
        kernel = choose_int4_kernel(in_features, out_features, device, allowed)
    return kernel


def head_int8(config: ModelConfig, fmt: object, quantized: bool, device: torch.device) -> bool:
    """Whether the output projection runs in grouped int8 (head_format.py says when it
    may, and times it under `auto`)."""
    from model.head_format import choose_head_int8, head_int8_applies

    if _mode == "torch":
        return False
    if _mode == "native":
        return head_int8_applies(config, fmt, quantized, device)
    return choose_head_int8(config, fmt, quantized, device)


def attention(name: str, device: torch.device | str) -> AttentionBackend:
    """The attention backend `--attention-backend` names, `auto` resolved by the plan."""
    device = torch.device(device)
    if device.type == "cpu" and _mode == "torch":
        if name == "cpu_paged":
            raise UnsupportedFormatError(
                "--attention-backend cpu_paged is a C kernel; --cpu-kernels torch keeps them off"
            )
        name = "torch_ref" if name == "auto" else name
    elif device.type == "cpu" and _mode == "native" and name == "auto":
        name = "cpu_paged"
    try:
        return attention_backend(name, device)
    except ValueError as exc:
        raise UnsupportedFormatError(str(exc)) from None


def use_kernels(model: torch.nn.Module, attention_name: str, device: str) -> None:
    """The attention backend, and with the CPU's C attention the C RMSNorm and decoder
    layers too: all come from one library. With the Triton attention on a GPU, RMSNorm and
    RoPE in one Triton kernel each (model/cuda_ops.py)."""
    model.attention = attention(attention_name, device)
    if model.attention.name == "cpu_paged":
        model.use_native_norm(NativeRmsNorm())
        model.use_native_layers()
    elif model.attention.name == "triton_paged" and torch.device(device).type == "cuda":
        from model.cuda_ops import TritonRmsNorm, triton_rope

        model.use_native_norm(TritonRmsNorm())
        model.use_rope_kernel(triton_rope)


def argmax_kernel() -> NativeArgmax | None:
    """The C argmax over CPU rows, or None: PyTorch's."""
    return _native_argmax() if _mode != "torch" else None


def describe(model: torch.nn.Module, small_step_threads: int, token_budget: int) -> str:
    """The plan a loaded model runs, read off the model itself, with the runner's choices."""
    from model.int6_linear import Int6Linear  # they ask this module
    from model.int8_group_linear import Int8GroupLinear
    from model.quantized_linear import Int4Linear

    try:
        level = isa() if _mode != "torch" else "unused"
    except NativeUnavailable as exc:
        level = f"unavailable ({exc})"
    int4 = sorted({m.kernel for m in model.modules() if isinstance(m, Int4Linear)})
    head = model.lm_head
    if isinstance(head, Int8GroupLinear | Int6Linear):
        head = "int8" if isinstance(head, Int8GroupLinear) else "int6"
    else:
        head = str(head.weight.dtype)
    c_layers = sum(getattr(layer, "native", None) is not None for layer in model.layers)
    return "; ".join(
        [
            f"--cpu-kernels {_mode}",
            f"C kernels {level}",
            f"attention {model.attention.name}",
            f"C norm and decoder layers in {c_layers} of {len(model.layers)}",
            f"int4 kernels {'/'.join(int4) if int4 else 'none'}",
            f"output projection {head.removeprefix('torch.')}",
            f"argmax {'C' if argmax_kernel() is not None else 'PyTorch'}",
            f"one-token steps on {small_step_threads} thread(s)",
            f"step token budget {token_budget}",
        ]
    )


@cache
def _native_argmax() -> NativeArgmax | None:
    try:
        return NativeArgmax()
    except NativeUnavailable:
        return None


def _native_or_refuse(what: str) -> None:
    try:
        native_int4_matmul("native")
    except NativeUnavailable as exc:
        raise UnsupportedFormatError(f"{what}: the C kernels are unavailable: {exc}") from None
