"""Whether `--quantization auto` lets a model's int4 layers take int8 activations on a CPU
whose int4 kernel has bf16 products (AVX-512 BF16) and whose int8 one has VNNI: decided per
model by measuring what the rounding costs it, not by a blanket rule.

Why per model: rounding each row's activations to 8 bits in groups of 32 (w4a8, what
llama.cpp computes for a Q4 file) costs some models much and others almost nothing. On
SmolLM2-135M Q4_1 (the default) it multiplies the teacher-forced KL against float32 by 4.7
(0.00083 to 0.00393); on Qwen2.5-Coder-1.5B Q4_K_M by 1.5 (0.00031 to 0.00046), where its
one-row decode products are ~10% faster on VNNI (docs/cpu-performance.md#accuracy). Where
the CPU has no bf16 products (AVX2) w4a8 is timed as any format is
(`int8_activations_in_auto`); this module serves the CPUs where it is not.

The probe: a fixed text, in the model's chat template, prefilled once as loaded (bf16
activations) and once with the int4 layers on the int8-activation kernel (the same bytes:
`Int4Linear.use_kernel`); the KL of the a8 next-token distributions from the bf16 ones,
averaged over its positions but the 5% farthest (`TRIMMED`). One position where two tokens
nearly tie can hold most of a plain mean: on Qwen2.5-Coder-1.5B one of 100 positions
(KL 0.11, the median 0.0002) put the mean at 0.0006 or 0.0020 depending on how the Q4_K
scales were held, the same kernels otherwise. Under `KL_THRESHOLD` each int4 shape's
kernel is chosen again among both (timed, as on AVX2: model/plan/int4_kernel.py); else
nothing changes. One kernel per layer for every row count, so outputs stay batch-invariant
within a process. Where the int6 kernel with int8 activations has its VNNI loop, the probe's
int8 forward puts the int6 (Q6_K) layers and output projection on it too, and under the
threshold each int6 shape takes whichever times faster (model/plan/int6_activations.py);
a grouped-int8 output projection likewise (model/plan/head_activations.py).

The KL is stored in the tuning store (model/plan/tuning.py), keyed by the model's file,
shape and formats (the store is per kernel build), so a restart does not probe again; it
is an accuracy figure, not a timing, so a busy machine does not make it measured again.
It runs after the weights load and before the C decoder layers are built, which read each
layer's kernel for its weight kind (model/plan/kernel_plan.py `use_kernels`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.plan.head_activations import w8a8_head_pays
from model.plan.int4_kernel import int4_kernel_for
from model.plan.int6_activations import int6_a8_vnni, vnni_beside_bf16, w6a8_pays
from model.plan.kernel_plan import Int4Kernels, KernelPlan
from model.plan.tuning import config_key, remembered
from model.plan.weight_format import WeightFormat
from model.quant.int4 import Int4Linear
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.split import split_name, split_parts
from model.text.chat_template import ChatTemplate
from model.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Trimmed mean KL (nats) of the probe's a8 distributions from its bf16 ones under which
# int8 activations may run. Measured: the default model 0.0049 (w4a8 multiplies its KL
# against float32 by 4.7: stays bf16), Qwen2.5-Coder-0.5B Q4_K_M 0.00024 and -1.5B 0.00048
# (by 1.5: int8 allowed), Gemma 3 270M Q4_K_M 0.00095; 0.002 is 2.4x under the first and
# 4x over the 1.5B (docs/cpu-performance.md#accuracy).
KL_THRESHOLD = 0.002
# What the probe's int8 forward puts on int8 activations: part of its stored KL's key.
A8_FORWARD = "int4, int6 (VNNI), grouped int8 output projection"
# The share of the probe's positions its mean leaves out, the farthest first.
TRIMMED = 0.05
QUESTION = "Explain what this function does, then give one example call."
ANSWER = (
    "def mean(xs):\n    return sum(xs) / len(xs)\n\n"
    "It returns the average of a list: mean([3, 4, 8]) is 15 / 3 = 5.0. The Seine flows "
    "through Paris, the capital of France."
)
BLOCK_SIZE = 16
# What this process probed, store or no store (the tests run without one): each key once.
_probed: dict[str, float] = {}


def probe_applies(plan: KernelPlan, quantization: str | None) -> bool:
    """Whether the probe is asked of a model built on `plan`."""
    return probe_asked(plan.mode, plan.device, plan.weight_format, plan.int4_kernels, quantization)


def probe_asked(
    mode: str, device: str, fmt: WeightFormat, int4_kernels: Int4Kernels, quantization: str | None
) -> bool:
    """`auto`'s format, bf16 activations on int4 layers of the C kernel, where the
    int8-activation one has VNNI (w4a8 available, not taken). The plan asks it too, before
    loading, to time the output projection in the form the probe may switch it to."""
    if quantization != "auto" or mode == "torch" or torch.device(device).type != "cpu":
        return False
    if fmt.quantization != "int4" or fmt.dtype != torch.bfloat16:
        return False
    if not any(q == "int4" and k == "native" for (q, *_), k in int4_kernels.items()):
        return False
    return vnni_beside_bf16()


def probe_ids(
    tokenizer: Tokenizer, template: ChatTemplate | None, max_tokens: int | None = None
) -> list[int]:
    """The probe text as the model reads a chat: in its template where it has one; its
    first `max_tokens` where the model was loaded for fewer positions than it holds."""
    if template is None:
        ids = tokenizer.encode(f"{QUESTION}\n{ANSWER}")
    else:
        messages = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": ANSWER},
        ]
        ids = template.prompt_ids(messages, tokenizer, add_generation_prompt=False)
    return ids[:max_tokens]


def next_token_logprobs(model: Llama, ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits at every position, [len(ids), vocab] fp32, in
    one prefill on a private cache."""
    blocks = -(-len(ids) // BLOCK_SIZE)
    cache = PagedKVCache.allocate(model.config, blocks, BLOCK_SIZE, model.dtype, model.device)
    batch = Batch.build([ids], [0], [list(range(blocks))], BLOCK_SIZE, all_logits=True)
    return torch.log_softmax(model(batch, cache), dim=-1)


def switchable_layers(model: Llama) -> list[Int4Linear]:
    return [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "native"]


def switchable_a8_layers(model: Llama) -> dict[str, Int6Linear | Int8GroupLinear]:
    """The int6 layers on bf16 activations, and the output projection if it is one, by
    name, where their int8-activation kernel is the VNNI loop (model/plan/int6_activations.py);
    and a grouped-int8 output projection on bf16 activations (model/plan/head_activations.py):
    the probe tries them too."""
    int6 = int6_a8_vnni()
    return {
        name: m
        for name, m in model.named_modules()
        if (isinstance(m, Int6Linear) and int6 and not m.int8_activations)
        or (isinstance(m, Int8GroupLinear) and m.fp32_output and not m.int8_activations)
    }


def a8_logprobs(model: Llama, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's two forwards: bf16 activations (as loaded), then int8 ones on every
    int4 layer now on the bf16 kernel (and every layer `switchable_a8_layers` names); the
    layers are left as they were."""
    layers, int6 = switchable_layers(model), list(switchable_a8_layers(model).values())
    bf16 = next_token_logprobs(model, ids)
    try:
        for layer in layers:
            layer.use_kernel("native_a8")
        for layer in int6:
            layer.use_int8_activations(True)
        a8 = next_token_logprobs(model, ids)
    finally:
        for layer in layers:
            layer.use_kernel("native")
        for layer in int6:
            layer.use_int8_activations(False)
    return bf16, a8


def probe_kl(model: Llama, ids: list[int]) -> float:
    """KL(bf16 || a8) per position, in nats, averaged over all but the TRIMMED share of
    positions with the largest; taken a block of positions at a time, as a 1.5B model's 100
    positions of 151,936 logits are 61 MB a tensor."""
    bf16, a8 = a8_logprobs(model, ids)
    per_position = torch.cat(
        [
            F.kl_div(
                a8[i : i + BLOCK_SIZE], bf16[i : i + BLOCK_SIZE], reduction="none", log_target=True
            ).sum(-1)
            for i in range(0, len(ids), BLOCK_SIZE)
        ]
    )
    kept = len(ids) - int(len(ids) * TRIMMED)
    return float(per_position.sort().values[:kept].mean())


def model_identity(path: Path) -> dict[str, object]:
    """The checkpoint's name and size: two files of one shape (another quantisation, a
    fine-tune) may round differently."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {"model": path.name, "bytes": sum(p.stat().st_size for p in files)}


def probed_plan(plan: KernelPlan, model: Llama, ids: list[int], path: Path) -> KernelPlan:
    """The plan with each int4 shape's kernel chosen among bf16 and int8 activations where
    the probe's KL is under the threshold (the model's layers switched to it), else `plan`."""
    key = {
        **model_identity(path),
        "config": config_key(model.config),
        "formats": plan.formats(),
        "a8": A8_FORWARD,
        "text": hashlib.sha256(str(ids).encode()).hexdigest()[:16],
    }
    entry = json.dumps(key, sort_keys=True, default=str)
    started, wall = time.thread_time(), time.perf_counter()
    if entry not in _probed:
        measure = partial(probe_kl, model, ids)
        _probed[entry] = remembered("activation_probe_trimmed_kl", key, measure, timed=False)
    kl = _probed[entry]
    cpu_s, wall_s = time.thread_time() - started, time.perf_counter() - wall
    taken = kl < KL_THRESHOLD
    kernels = dict(plan.int4_kernels)
    if taken:
        plan = int6_on_int8_activations(plan, model)
        device = torch.device(plan.device)
        for (quantization, in_features, out_features), kernel in plan.int4_kernels.items():
            if quantization == "int4" and kernel == "native":
                allowed = ("native_a8", "native")  # `native` mode: int8 activations, untimed
                choice = int4_kernel_for(plan.mode, in_features, out_features, device, allowed)
                kernels[(quantization, in_features, out_features)] = choice
        for layer in switchable_layers(model):
            layer.use_kernel(kernels.get(("int4", layer.in_features, layer.out_features), "native"))
    logger.info(
        "int4 layers' activations: %s (probe KL of int8 against bf16 activations %.5f, the "
        "mean of all but the farthest 5%% of positions, "
        "threshold %.5f, %d positions, %.2f s, %.2f s of this thread's CPU time; kernels per "
        "shape: %s)",
        "int8 allowed" if taken else "bf16",
        kl,
        KL_THRESHOLD,
        len(ids),
        wall_s,
        cpu_s,
        ", ".join(f"[{o} x {i}] {k}" for (q, i, o), k in kernels.items() if q == "int4"),
    )
    return dataclasses.replace(plan, int4_kernels=kernels)


def int6_on_int8_activations(plan: KernelPlan, model: Llama) -> KernelPlan:
    """Each int6 shape the probe tried on int8 activations switched to them where they time
    faster (`w6a8_pays`; a grouped-int8 output projection `w8a8_head_pays`), and the plan's
    formats saying so: 'w6a8' for the layer or the output projection, 'int4+w6a8' for a
    split Q/K/V layer's V, 'w8a8' for a grouped-int8 output projection."""
    formats, head = dict(plan.layer_quantizations), plan.head
    layers = switchable_a8_layers(model)
    shapes = {_shape(m) for m in layers.values()}
    pays = {shape: _a8_pays(*shape) for shape in sorted(shapes)}
    for name, layer in layers.items():
        if not pays[_shape(layer)]:
            continue
        layer.use_int8_activations(True)
        if isinstance(layer, Int8GroupLinear):
            head = "w8a8"
            continue
        if layer.logits:
            head = "w6a8"
            continue
        key = name.removesuffix(".second")  # a split layer's V part
        parts = split_parts(formats.get(key))
        formats[key] = "w6a8" if parts is None else split_name(parts[0], "w6a8")
    return dataclasses.replace(plan, layer_quantizations=formats, head=head)


def _shape(layer: Int6Linear | Int8GroupLinear) -> tuple[int, int, bool, bool]:
    """(in, out, output projection, grouped int8)."""
    int8 = isinstance(layer, Int8GroupLinear)
    return layer.in_features, layer.out_features, int8 or layer.logits, int8


def _a8_pays(in_features: int, out_features: int, logits: bool, int8: bool) -> bool:
    if int8:
        return w8a8_head_pays(in_features, out_features)
    return w6a8_pays(in_features, out_features, logits)
