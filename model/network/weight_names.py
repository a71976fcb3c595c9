"""Where each tensor of a checkpoint lands in the network: HF names (the name every
checkpoint reader in model/checkpoint/ hands over) mapped onto our fused parameters
(Q/K/V in one weight, gate/up in one, each expert's gate/up in one), every parameter
filled exactly once."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from model.checkpoint.file_blocks import FileBlocks

# transformers' names of a mixture of experts' tensors (model/network/moe.py's are `moe.*`).
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
_ROUTER = re.compile(r"\.mlp\.gate\.(weight|bias)$")
# gpt-oss's sinks: `self_attn.sinks` in transformers, `attn_sinks.weight` in a GGUF.
_SINKS = re.compile(r"self_attn\.sinks(\.weight)?$")


def _expert_part(name: str, expert_ffn_dim: int) -> tuple[str, int] | None:
    """An HF expert tensor's name -> (our name, row offset into the fused weight)."""
    m = _EXPERT.search(name)
    if m is None:
        return None
    ours = "down_proj" if m.group(2) == "down" else "gate_up_proj"
    row = expert_ffn_dim if m.group(2) == "up" else 0
    return name.replace(m.group(0), f".moe.experts.{m.group(1)}.{ours}."), row


def _expert_keys(layer: int, n_experts: int, expert_ffn_dim: int, bias: bool) -> set[str]:
    kinds = (".weight", "_bias") if bias else (".weight",)
    return {
        f"layers.{layer}.moe.experts.{e}.{ours}{kind}@{row}"
        for e in range(n_experts)
        for ours, row in (("gate_up_proj", 0), ("gate_up_proj", expert_ffn_dim), ("down_proj", 0))
        for kind in kinds
    }


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | FileBlocks]]
) -> None:
    """Copies HF-named tensors into `model`'s (fused) parameters; every parameter must be
    filled exactly once, or loading fails naming what is missing. A tensor may come
    as consecutive blocks of its rows under one name, or still in a GGUF file's blocks."""
    c = model.config
    # HF name suffix -> (our parameter suffix, row offset into the fused weight)
    fused = {
        "self_attn.q_proj": ("qkv_proj", 0),
        "self_attn.k_proj": ("qkv_proj", c.q_size),
        "self_attn.v_proj": ("qkv_proj", c.q_size + c.kv_size),
        "self_attn.o_proj": ("o_proj", 0),
        "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", c.ffn_dim),
        "mlp.down_proj": ("down_proj", 0),
    }
    params = dict(model.named_parameters())
    quantized = model.quantized_modules()
    expected = {f"{n}@0" for n in params if "proj" not in n and "qkv_bias" not in n}
    expected.add("lm_head.weight@0")
    attention = [v for k, v in fused.items() if k.startswith("self_attn")]
    for i in range(c.n_layers):
        sparse = c.is_sparse(i)
        parts = attention if sparse else fused.values()
        expected |= {f"layers.{i}.{ours}.weight@{row}" for ours, row in parts}
        if sparse:
            expected |= _expert_keys(i, c.n_experts, c.expert_ffn_dim, c.expert_bias)
        if c.qkv_bias:
            expected |= {
                f"layers.{i}.qkv_bias@{row}" for row in (0, c.q_size, c.q_size + c.kv_size)
            }
    if c.tie_embeddings:
        expected.discard("lm_head.weight@0")
    seen: set[str] = set()
    rows_in: dict[str, int] = {}  # a tensor that comes in blocks of rows: rows so far
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and c.tie_embeddings:
            continue  # some tied checkpoints still store a copy
        block_row = rows_in.get(hf_name, 0)
        rows_in[hf_name] = block_row + (tensor.shape[0] if len(tensor.shape) > 1 else 1)
        row = 0
        expert = _expert_part(name, c.expert_ffn_dim)
        if expert is not None:
            name, row = expert
            name = name.replace("_proj.bias", "_proj_bias")
        else:
            name = _ROUTER.sub(r".moe.router.\1", name)
        for hf_part, (ours, offset) in fused.items():
            if expert is None and f".{hf_part}." in name:
                name, row = name.replace(hf_part, ours), offset
                break
        name = name.replace("qkv_proj.bias", "qkv_bias").replace("o_proj.bias", "o_bias")
        name = _SINKS.sub("sinks", name)
        name = name.replace("self_attn.q_norm", "q_norm").replace("self_attn.k_norm", "k_norm")
        key = f"{name}@{row}"
        row += block_row
        if key not in expected:
            raise ValueError(f"unexpected weight {hf_name} with shape {tuple(tensor.shape)}")
        seen.add(key)
        if name == "embed_tokens.weight" and c.tie_embeddings and "lm_head.weight" in quantized:
            quantized["lm_head.weight"].load_rows(row, tensor)  # tied: quantised from it
            if model.embed_from_head:
                continue
        if name in quantized:
            quantized[name].load_rows(row, tensor)
            continue
        if isinstance(tensor, FileBlocks):  # only quantised layers read blocks
            tensor = tensor.dequantize()
        dest = params[name][row : row + tensor.shape[0]]  # fused rows, or all of it
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
    missing = expected - seen
    if missing:
        names = sorted(m.split("@")[0] for m in missing)
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {names[:3]}")
