"""Builds the kernel plan (model/plan/kernel_plan.py) once, before any weight is read, from
what the checkpoint says of its weights, the model's shapes, the flags and the device. Every
choice that times this machine is made here, in this order: the weight format, the layers
that run in their own format, the attention backend, the int4 kernel of each shape, the
output projection and the argmax. One choice waits for the weights: whether `auto`'s int4
layers may take int8 activations where the CPU has bf16 products too, an accuracy probe of
the loaded model (model/plan/activation_probe.py) that may change their kernels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from model.config import ModelConfig
from model.plan.activation_probe import probe_asked
from model.plan.format_choice import resolve_weight_format
from model.plan.head_format import head_int8, head_int8_applies
from model.plan.int4_kernel import int4_format_kernel
from model.plan.int6_activations import int6_a8_vnni
from model.plan.kernel_plan import Int4Kernels, KernelPlan, attention_name, native_argmax_available
from model.plan.layer_formats import (
    key_shape,
    layer_quantizations,
    linear_keys,
    quantized_head_format,
    split_rows,
)
from model.plan.mode import allows_native, check_mode, check_quantization
from model.plan.weight_format import WeightFormat
from model.quant.split import split_parts


@dataclass(frozen=True)
class CheckpointFacts:
    """What the checkpoint says of its weights, read before any of them (model/checkpoint/
    base.py); the defaults are a model of float weights (random ones, a safetensors one)."""

    checkpoint_bits: int | None = None  # the widest quantised linear type, None: float
    wide_linears: frozenset[str] = frozenset()  # stored in more than 4 bits
    q5_0_linears: frozenset[str] = frozenset()
    q6_k_linears: frozenset[str] = frozenset()
    mxfp4_linears: frozenset[str] = frozenset()
    head_quantized: bool = False
    head_block_type: str | None = None
    # (Q and K's block type, V's)
    split_qkv_linears: Mapping[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanFlags:
    """The flags the plan follows (`load_model`'s arguments)."""

    dtype: torch.dtype | str = torch.float32
    quantization: str | None = None
    batch_invariant: bool = False
    attention_backend: str = "auto"
    cpu_kernels: str = "auto"
    quantized_head: bool = True  # False under tensor parallelism: the head stays in dtype
    tensor_parallel: bool = False  # each rank holds some heads' rows of a fused layer
    facts: CheckpointFacts = field(default_factory=CheckpointFacts)


def build_kernel_plan(config: ModelConfig, device: str, flags: PlanFlags) -> KernelPlan:
    mode = check_mode(flags.cpu_kernels)
    facts, dev = flags.facts, torch.device(device)
    fmt = weight_format_for(
        flags.dtype,
        flags.quantization,
        config,
        device,
        facts.checkpoint_bits,
        flags.batch_invariant,
        some_4_bit=len(facts.wide_linears) < len(linear_keys(config)),
        mode=mode,
    )
    own = layer_quantizations(
        fmt,
        config,
        dev,
        facts.wide_linears,
        facts.q5_0_linears,
        flags.quantization == "auto",
        facts.q6_k_linears,
        mode,
        facts.mxfp4_linears,
        {} if flags.tensor_parallel else facts.split_qkv_linears,
    )
    attention = attention_name(mode, flags.attention_backend, device)
    # Where the C decoder layers will take the int4 layers (model/network/decoder_layer.py).
    c_layers = (
        attention == "cpu_paged" and not flags.tensor_parallel and fmt.dtype == torch.bfloat16
    )
    kernels = int4_kernels(mode, config, fmt, own, dev, c_layers)
    head = None
    quantized = facts.head_quantized
    if flags.quantized_head and mode != "torch" and head_int8_applies(config, fmt, quantized, dev):
        # The format it would take, timed against bf16 (model/plan/head_format.py).
        candidate = quantized_head_format(config, facts.head_block_type, fmt, mode)
        probed = probe_asked(mode, device, fmt, kernels, flags.quantization)
        a8_form = head_a8_form(candidate, mode, probed)
        if head_int8(mode, config, fmt, quantized, dev, candidate, a8_form):
            head = candidate
    return KernelPlan(
        mode=mode,
        device=device,
        weight_format=fmt,
        n_linears=len(linear_keys(config)),
        layer_quantizations=own,
        head=head,
        int4_kernels=kernels,
        attention=attention,
        argmax=mode != "torch" and native_argmax_available(),
    )


def int4_kernels(
    mode: str,
    config: ModelConfig,
    fmt: WeightFormat,
    own: dict[str, str],
    device: torch.device,
    c_layers: bool = False,
) -> Int4Kernels:
    """The kernel of each int4, w4a8 and mxfp4 layer shape the model holds, every shape
    being known from its config; `c_layers`: the C decoder layers will run them."""
    kernels: Int4Kernels = {}
    for key in linear_keys(config):
        quantization = own.get(key, fmt.quantization)
        shape = key_shape(config, key)
        parts = split_parts(quantization)
        if parts is not None:  # the int4 part of a split Q/K/V layer: Q and K
            quantization, shape = parts[0], (shape[0], split_rows(config)[0])
        if (quantization, *shape) not in kernels:
            kernel = int4_format_kernel(mode, quantization, *shape, device, c_layers)
            if quantization == "mxfp4":  # the C kernel wherever it may run, untimed
                kernel = mxfp4_kernel(mode, fmt)
            if kernel is not None:
                kernels[(quantization, *shape)] = kernel
    return kernels


def mxfp4_kernel(mode: str, fmt: WeightFormat) -> str:
    """An MXFP4 layer's kernel: the C one where it may run, with the int8 activations the
    model's format asks for as w4a8 does (llama.cpp's MXFP4 product rounds them so too)."""
    if not allows_native(mode):
        return "torch"
    return "native_a8" if fmt.quantization == "w4a8" else "native"


def weight_format_for(
    dtype: torch.dtype | str,
    quantization: str | None,
    config: ModelConfig,
    device: str,
    checkpoint_bits: int | None,
    batch_invariant: bool = False,
    some_4_bit: bool = False,
    mode: str = "auto",
) -> WeightFormat:
    """The weight format the flags name, or `auto`'s choice for this machine."""
    if isinstance(dtype, torch.dtype) and quantization != "auto" and not batch_invariant:
        if torch.device(device).type == "cpu":
            check_quantization(mode, quantization)
        return WeightFormat(dtype, quantization)
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return resolve_weight_format(
        config,
        torch.device(device),
        dtype_name,
        quantization or "none",
        checkpoint_bits,
        batch_invariant,
        some_4_bit,
        mode,
    )


def head_a8_form(candidate: str, mode: str, probed: bool) -> str | None:
    """The head's format on int8 activations where the activation probe will run after
    loading (`probed`, model/plan/activation_probe.py) and may switch it. A head timed so
    where no probe follows stayed in its slower form: gpt-oss's shape, whose layers hold no
    int4, kept a Q8_0 head in int8 at 22 ms, timed at 15 in w8a8, where bf16 took 17."""
    if mode != "auto" or not probed:
        return None
    if candidate == "int6":
        return "w6a8" if int6_a8_vnni() else None
    return "w8a8" if candidate == "int8" else None
