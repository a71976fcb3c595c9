"""gpt-oss (OpenAI's open-weight mixture of experts): Llama's layer with

- a bias on the Q, K, V and O projections, and a learned logit per query head (its
  attention sink) that joins each softmax's denominator and weighs no value;
- layers alternating between a sliding window (even layers) and full attention (odd
  ones), every layer with the same YaRN-scaled RoPE;
- a mixture of experts in every layer (model/network/moe.py): a router with a bias, a
  softmax over the top `num_experts_per_tok` logits (the same as a renormalised top-k of
  the full softmax), experts with biases on gate/up and down whose gate is clamped at
  `swiglu_limit`, gated as gate * sigmoid(1.702 gate), and multiplied by up + 1 (up
  clamped to +-limit).

transformers stores a layer's experts stacked: `gate_up_proj` [experts, hidden, 2 ffn],
multiplied as x @ W (transposed against a linear layer's weight) with gate and up in
alternate columns, and `down_proj` [experts, ffn, hidden]; they are split here into each
expert's gate, up and down. Its MXFP4 checkpoints (`quant_method: mxfp4`) store them as
`*_blocks`/`*_scales` pairs, already in a linear layer's rows; each expert's rows keep
their blocks (model/quant/mxfp4.py holds them as stored). llama.cpp writes them as three
stacks plus their biases (`ffn_{gate,up,down}_exps.{weight,bias}`), the sinks as
`attn_sinks.weight` and the norm before the experts as `post_attention_norm`, and fixes
the limit (7) and the gain (1.702).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields

if TYPE_CHECKING:  # model/checkpoint/ imports the families: no import back at run time
    from model.checkpoint.file_blocks import FileBlocks

_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
# llama.cpp's graph hard-codes these; transformers reads them from config.json.
_LIMIT, _ALPHA = 7.0, 1.702


def _experts(n_experts: int, expert_ffn_dim: int, used: int) -> Fields:
    return {
        "qkv_bias": True,
        "o_bias": True,
        "attention_sinks": True,
        "n_experts": n_experts,
        "n_experts_used": used,
        "expert_ffn_dim": expert_ffn_dim,
        "norm_topk_prob": True,
        "expert_bias": True,
    }


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    if cfg.get("attention_bias") is False:
        raise UnsupportedModelError(f"{source}: gpt-oss without attention_bias is not supported")
    n_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
    ]
    return {
        **_experts(cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"]),
        "sliding_window": cfg.get("sliding_window"),
        "full_attention_layers": tuple(i for i, t in enumerate(types) if t != "sliding_attention"),
        "swiglu_limit": float(cfg.get("swiglu_limit", _LIMIT)),
        "swiglu_alpha": float(cfg.get("swiglu_alpha", _ALPHA)),
    }


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    rope: dict[str, Any] = {}
    if md.get("rope.scaling.type") == "yarn":
        # As the checkpoint's config.json says (transformers' default for gpt-oss too):
        # the YaRN band's bounds are not rounded.
        rope = {
            "rope_type": "yarn",
            "factor": md["rope.scaling.factor"],
            "original_max_position_embeddings": md["rope.scaling.original_context_length"],
            "truncate": False,
        }
    return {
        **_experts(md["expert_count"], md["expert_feed_forward_length"], md["expert_used_count"]),
        "sliding_window": md.get("attention.sliding_window"),
        # llama.cpp's fixed pattern: every second layer (the odd ones) sees everything.
        "full_attention_layers": tuple(range(1, md["block_count"], 2)),
        "swiglu_limit": _LIMIT,
        "swiglu_alpha": _ALPHA,
        "rope": rope,
    }


def _split_hf(
    name: str, tensor: torch.Tensor | FileBlocks
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """Stacked experts -> each expert's `gate_proj`, `up_proj` and `down_proj` weight and
    bias in a linear layer's orientation; the router under the name the other families'
    routers have."""
    m = _STACKED.fullmatch(name)
    if m is None:
        yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        return
    prefix, part, bias = m.group(1), m.group(2), m.group(3) is not None
    if not isinstance(tensor, torch.Tensor):  # an MXFP4 stack's FileBlocks
        yield from _split_mxfp4(prefix, part, tensor)
        return
    kind = "bias" if bias else "weight"
    for expert, value in enumerate(tensor):
        if part == "down_proj":
            yield f"{prefix}.{expert}.down_proj.{kind}", value if bias else value.t()
            continue
        gate, up = value[..., ::2], value[..., 1::2]
        if not bias:
            gate, up = gate.t(), up.t()
        yield f"{prefix}.{expert}.gate_proj.{kind}", gate.contiguous()
        yield f"{prefix}.{expert}.up_proj.{kind}", up.contiguous()


def _split_mxfp4(prefix: str, part: str, stack: FileBlocks) -> Iterator[tuple[str, FileBlocks]]:
    """An MXFP4 stack (model/checkpoint/hf_mxfp4.py): its blocks are already a linear
    layer's rows ([experts, out, in / 32, 16], what transformers' dequantisation transposes
    into `x @ W`'s columns), so each expert's gate and up are its even and odd rows, moved
    as the blocks they are."""
    for expert in range(stack.stack):
        rows = stack.matrix(expert)
        if part == "down_proj":
            yield f"{prefix}.{expert}.down_proj.weight", rows
            continue
        gate, up = (replace(rows, raw=rows.raw[first::2].contiguous()) for first in (0, 1))
        yield f"{prefix}.{expert}.gate_proj.weight", gate
        yield f"{prefix}.{expert}.up_proj.weight", up


GPT_OSS = Family(
    "gpt_oss",
    ("gpt_oss",),
    gguf_permutes_qk=False,
    hf_fields=_hf_fields,
    gguf_fields=_gguf_fields,
    gguf_architecture="gpt-oss",
    split_hf=_split_hf,
    gguf_names={"post_attention_norm": "post_attention_layernorm"},
)
