"""One decoder layer of every supported family: RMSNorm, attention with RoPE (GQA, with
the Q/K/V bias of Qwen2 and the per-head Q/K norms of Qwen3 where the config has them, a
sliding window where it sets one, OLMoE's Q/K norms over whole projections) and the gated
FFN (SwiGLU, or Gemma's GELU-tanh; a mixture of experts, model/network/moe.py, in the
layers the config makes sparse), each with a residual add (normalised first in Gemma 3).

A pure function of tensors and one layer's paged cache; Q/K/V and gate/up are fused into
one matmul each (fewer, larger GEMMs). `Llama` (model/network/llama.py) stacks these.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model.attention.base import AttentionBackend
from model.config import ModelConfig
from model.native.layer import NativeDecoderLayer, takes_inputs
from model.native.layer_weight import (
    INT4,
    INT4_A8,
    INT4K,
    INT4K_A8,
    INT5,
    INT5_A8,
    INT6,
    INT6_A8,
    INT8_GROUPS,
    INT8_GROUPS_A8,
    MXFP4,
    MXFP4_A8,
    NativeWeight,
    split_weight,
)
from model.network.batch import Batch
from model.network.moe import SparseMoE
from model.network.rope import apply_rope
from model.quant.int4 import NATIVE_INT4_KERNELS, Int4Linear
from model.quant.int5 import Int5Linear
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.mxfp4 import Mxfp4Linear
from model.quant.split import SplitLinear

NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor | None]
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The same formula in one native call (model/native/ops.py), set by
        # `Llama.use_native_norm`; it returns None where it does not apply.
        self.native: NormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = self.native(x, self.weight, self.eps)
            if out is not None:
                return out
        # Normalise in fp32 whatever the model dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.config = config
        self.scale = config.query_scale or config.head_dim**-0.5
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.qkv_proj = nn.Linear(config.dim, config.q_size + 2 * config.kv_size, bias=False)
        # Kept beside the projection rather than in it: quantised projections have no bias.
        self.qkv_bias = (
            nn.Parameter(torch.zeros(config.q_size + 2 * config.kv_size))
            if config.qkv_bias
            else None
        )
        q_width, k_width = (
            (config.q_size, config.kv_size) if config.qk_norm_whole else (config.head_dim,) * 2
        )
        qk_norm = config.qk_norm or config.qk_norm_whole
        self.q_norm = RMSNorm(q_width, config.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_width, config.norm_eps) if qk_norm else None
        self.o_proj = nn.Linear(config.q_size, config.dim, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(config.dim)) if config.o_bias else None
        # gpt-oss: a logit per query head that joins its softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.attention_sinks else None
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.moe = SparseMoE(config) if config.is_sparse(index) else None
        dense = self.moe is None
        self.gate_up_proj = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False) if dense else None
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False) if dense else None
        # Gemma 3 normalises what attention and the MLP add to the residual stream too.
        sandwich = config.sandwich_norms
        self.attn_out_norm = RMSNorm(config.dim, config.norm_eps) if sandwich else None
        self.ffn_out_norm = RMSNorm(config.dim, config.norm_eps) if sandwich else None
        self.act = F.silu if config.hidden_act == "silu" else partial(F.gelu, approximate="tanh")
        # Under tensor parallelism O and down hold a slice of their input columns: their
        # outputs are partial sums the ranks add up (model/parallel/comm.py).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The same layer around attention in two native calls (model/native/layer.py),
        # set by `Llama.use_native_layers` where every part of it fits.
        self.native: NativeDecoderLayer | None = None
        # RoPE in one kernel where the device has one (model/cuda_ops.py), set by
        # `Llama.use_rope_kernel`; it returns None where it does not apply.
        self.rope_kernel: RopeKernel | None = None

    def use_native(self) -> bool:
        """Runs around attention in two native calls where every part fits (bf16 norms
        and bias, every projection on a C kernel) and without tensor parallelism. With a
        mixture of experts the C layer runs the router and experts after attention too
        (model/native/moe_router.c); it has no whole-projection Q/K norms (OLMoE)."""
        if self.config.qk_norm_whole:
            self.native = None
            return False
        norms = (self.input_layernorm, self.post_attention_layernorm, self.q_norm, self.k_norm)
        norms += (self.attn_out_norm, self.ffn_out_norm)
        tensors = [n.weight for n in norms if n is not None]
        tensors += [b for b in (self.qkv_bias, self.o_bias) if b is not None]
        linears = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        projections = [_native_weight(p) for p in linears if p is not None]
        fits = (
            self.reduce is None
            and all(t.dtype == torch.bfloat16 for t in tensors)
            and None not in projections
        )
        self.native = NativeDecoderLayer(self, projections) if fits else None
        if self.moe is not None:
            self.moe.use_native(
                _native_weight if fits else lambda _: None, self.post_attention_layernorm
            )
            if self.native is not None:
                self._moe_in_c_layer()
        return fits

    def forward(
        self,
        h: torch.Tensor,
        batch: Batch,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention: AttentionBackend,
        plan: object,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        c, scale = self.config, self.scale
        if (
            self.native is not None
            # LoRA updates hook the PyTorch projections, unless the C layer has them too
            and (batch.lora_slots is None or self.native.lora)
            and takes_inputs(h, rope[0])
        ):
            if self.moe is not None and self.native.moe is not self.moe.native:
                self._moe_in_c_layer()
            decodes = getattr(plan, "decodes", None)  # the C attention's plan of decodes only
            out = None
            if decodes is not None:
                out = self.native.decode(h, *rope, k_cache, v_cache, decodes, scale, window)
            if out is None:
                q, k, v = self.native.attention_input(h, *rope)
                attn = attention.forward(
                    q, k, v, k_cache, v_cache, batch, plan, scale, window, self.sinks
                )
                out = self.native.attention_output(h, attn)
            if self.moe is not None and self.native.moe is None:  # stopped after attention
                out = self.moe.residual(out, self.post_attention_layernorm)
            return out
        qkv = self.qkv_proj(self.input_layernorm(h))
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if c.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            qkv = torch.cat(
                [self._whole_norm(q, self.q_norm), self._whole_norm(k, self.k_norm), v], -1
            )
        qk, v = qkv.split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        qk = qk.reshape(-1, c.n_heads + c.n_kv_heads, c.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not c.qk_norm_whole:
            q, k = qk.split([c.n_heads, c.n_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        rotated = self.rope_kernel(qk, *rope) if self.rope_kernel is not None else None
        qk = rotated if rotated is not None else apply_rope(qk, *rope)
        q, k = qk.split([c.n_heads, c.n_kv_heads], dim=1)
        v = v.reshape(-1, c.n_kv_heads, c.head_dim)
        attn = attention.forward(q, k, v, k_cache, v_cache, batch, plan, scale, window, self.sinks)
        out = self._added(self.o_proj(attn.reshape(-1, c.q_size)), self.attn_out_norm)
        h = h + (out if self.o_bias is None else out + self.o_bias)
        return h + self._added(self._mlp(self.post_attention_layernorm(h)), self.ffn_out_norm)

    def _moe_in_c_layer(self) -> None:
        """The C layer runs the experts' C call that `moe.native` names, or none once they
        were put back in PyTorch (`moe.native = None`)."""
        assert self.native is not None and self.moe is not None
        experts = self.moe.native
        if experts is not None and experts.router is not None:
            self.native.use_moe(experts, experts.pointer)
        else:
            self.native.use_moe(None)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        assert self.gate_up_proj is not None and self.down_proj is not None
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def _whole_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """OLMoE's norm over a whole Q or K projection. Under tensor parallelism each rank
        holds some heads' rows: the ranks add up their sums of squares and their widths (a
        KV head two ranks both hold counts twice in both, so the mean stays right)."""
        if self.reduce is None:
            return norm(x)
        xf = x.float()
        width = torch.full_like(xf[:, :1], xf.shape[-1])
        sums = self.reduce(torch.cat([xf.pow(2).sum(-1, keepdim=True), width], dim=-1))
        xf = xf * torch.rsqrt(sums[:, :1] / sums[:, 1:] + norm.eps)
        return norm.weight * xf.to(x.dtype)

    def _added(self, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """What a sub-block adds to the residual stream: the ranks' partial sums added up,
        then normalised where the family does that."""
        out = self.reduce(out) if self.reduce else out
        return norm(out) if norm is not None else out


def _native_weight(proj: nn.Module) -> NativeWeight | None:
    """A projection as the C layer reads it; None where no C kernel multiplies it."""
    if isinstance(proj, SplitLinear):
        first, second = _native_weight(proj.first), _native_weight(proj.second)
        if first is None or second is None:
            return None
        return split_weight(first, second, proj.first_rows)
    if isinstance(proj, Int4Linear) and proj.kernel in NATIVE_INT4_KERNELS:
        if proj.superblocks:
            kind = INT4K_A8 if proj.kernel == "native_a8" else INT4K
        else:
            kind = INT4_A8 if proj.kernel == "native_a8" else INT4
        return proj.weight_int4, proj.scales_and_zeros, kind
    if isinstance(proj, Int8GroupLinear) and not proj.fp32_output:
        return (
            proj.weight_int8,
            proj.scales,
            INT8_GROUPS_A8 if proj.int8_activations else INT8_GROUPS,
        )
    if isinstance(proj, Int5Linear):
        return proj.weight_int5, proj.scales, INT5_A8 if proj.int8_activations else INT5
    if isinstance(proj, Int6Linear) and not proj.logits:
        return proj.weight_int6, proj.scales, INT6_A8 if proj.int8_activations else INT6
    if isinstance(proj, Mxfp4Linear) and proj.on_c_kernel:
        kind = MXFP4_A8 if proj.kernel == "native_a8" else MXFP4
        return proj.weight_mxfp4, proj.weight_mxfp4, kind  # the scales lie in the blocks
    return None
