"""A mixture-of-experts MLP (Qwen3-MoE, OLMoE, Mixtral, gpt-oss): a softmax router in fp32 picks
the top `n_experts_used` of `n_experts` SwiGLU experts for each token, their weights
renormalised to sum to 1 where the config says so (gpt-oss's softmax over its top-k logits is
that renormalisation), and the token's output is the weighted sum of theirs. gpt-oss's
router and experts carry biases and its experts clamp their gate, in both paths.

A step's token slots are grouped by expert (sorted by expert id), so each chosen expert
runs once over all the tokens that chose it and its weights are read once per step
however many tokens chose it; experts no token chose are not read at all. A token's k
weighted outputs are summed in the order of its top-k, whatever else shares the step. Each expert's
gate/up and down are ordinary linear layers, so the loader swaps them for quantised ones
(model/quant/) as it does the dense layers'. Under tensor parallelism every rank holds
every expert's slice of FFN rows (model/parallel/plan.py): its output is a partial sum
the decoder layer adds up across ranks, as after a dense MLP. A step captured in a CUDA
graph cannot group (the counts live on the device): it runs every expert (`every_expert`).
Where the C decoder layer runs a layer's attention and every expert's products have a C
kernel, the post-attention norm, the router and the experts run in C too
(model/native/moe.py), in the C layer's own call; this module's `route` is their reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.native.layer_weight import NativeWeight
from model.native.moe import MoeRouter, NativeMoeExperts


class Expert(nn.Module):
    """One SwiGLU expert, gate and up fused into one matmul; gpt-oss's with biases (kept
    beside the projections: quantised ones have none) and its clamped gate."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, ffn_dim = config.dim, config.expert_ffn_dim
        self.gate_up_proj = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)
        bias = config.expert_bias
        self.gate_up_proj_bias = nn.Parameter(torch.empty(2 * ffn_dim)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is None:
            out = self.down_proj(F.silu(gate) * up)
        else:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)  # in transformers' order of ops
            out = self.down_proj((up + 1) * glu)
        return out if self.down_proj_bias is None else out + self.down_proj_bias


class Router(nn.Module):
    """The router's weight, [n_experts, dim], and gpt-oss's bias; not a linear layer, so it
    is never quantised: a rounded router can pick other experts, a larger error than any
    rounded expert's."""

    def __init__(self, n_experts: int, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.n_experts_used
        self.norm_topk_prob = config.norm_topk_prob
        self.router = Router(config.n_experts, config.dim, config.expert_bias)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.n_experts))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        # The experts in one C call, set by `use_native` where every product has a C kernel.
        self.native: NativeMoeExperts | None = None

    def use_native(
        self,
        native_weight: Callable[[nn.Module], NativeWeight | None],
        norm: nn.Module | None = None,
    ) -> bool:
        """Runs the experts in one C call where `native_weight` gives every expert's gate/up
        and down as the C layer reads them; else (or with None) in PyTorch. With `norm`
        (the post-attention RMSNorm, bf16), the C call holds it and the router too."""
        gate_up = [native_weight(e.gate_up_proj) for e in self.experts]
        down = [native_weight(e.down_proj) for e in self.experts]
        self.native = None
        if None in gate_up or None in down:
            return False
        ffn = self.experts[0].down_proj.in_features
        dim = self.experts[0].down_proj.out_features
        biases = None
        if self.experts[0].gate_up_proj_bias is not None:  # gpt-oss: stacked for the C call
            parts = ("gate_up_proj_bias", "down_proj_bias")
            biases = tuple(
                torch.stack([getattr(e, part).detach() for e in self.experts]).contiguous()
                for part in parts
            )
            if any(b.dtype != torch.bfloat16 for b in biases):
                return False
        self.native = NativeMoeExperts(
            gate_up,  # type: ignore[arg-type]
            down,  # type: ignore[arg-type]
            self.top_k,
            dim,
            ffn,
            biases,  # type: ignore[arg-type]
            self.limit,
            self.alpha,
            self._c_router(norm),
        )
        return True

    def _c_router(self, norm: nn.Module | None) -> MoeRouter | None:
        """The router as the C call reads it: bf16 copies where PyTorch's `route` rounds the
        weight to the bf16 activations' dtype too."""
        if norm is None or norm.weight.dtype != torch.bfloat16:
            return None
        bias = self.router.bias
        return MoeRouter(
            norm.weight.detach().contiguous(),
            norm.eps,
            self.router.weight.detach().to(torch.bfloat16).contiguous(),
            None if bias is None else bias.detach().to(torch.bfloat16).contiguous(),
            self.norm_topk_prob,
        )

    def residual(
        self, h: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """h plus the experts' output for norm(h): the router here, the experts in one C call
        where `use_native` set one and the rows fit it (contiguous bf16 on the CPU)."""
        x = norm(h)
        if (
            self.native is not None
            and x.dtype == h.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
            and h.is_contiguous()
        ):
            weights, ids = self.route(x)
            return self.native.add(x, ids, weights, h)
        return h + self(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]), as transformers routes: the
        logits in the activations' dtype, softmax and renormalisation in fp32; of equal
        probabilities the lower expert index first."""
        bias = self.router.bias
        logits = F.linear(
            x, self.router.weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        )
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        # The greatest first, ties in index order: the C router's rule (topk_select.c). Ties
        # are common once logits are rounded to bf16, and torch.topk leaves their order to
        # its sort's internals.
        weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, ids = weights[..., : self.top_k], ids[..., : self.top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, weights, ids)
        slots = ids.flatten()
        # Token slots sorted by expert: each expert's tokens are one contiguous run.
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        slot_weights = weights.flatten()[order].unsqueeze(1)
        # Each slot's weighted output, in sorted order; a token's k outputs are then put
        # back side by side and summed. `index_add_` did the same in place, but in bf16 on
        # the CPU it took 2.8 ms a call, more than the experts' products.
        outputs = x.new_empty(len(slots), x.shape[1])
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                run = slice(start, start + count)
                outputs[run] = expert(x[tokens[run]]) * slot_weights[run]
                start += count
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(len(order), device=order.device)
        return outputs[unsorted].view(-1, self.top_k, x.shape[1]).sum(dim=1)

    def every_expert(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Every expert over every token, each weighted by what the router gave it (zero
        where it was not chosen): the same sum with no host sync, for a step captured in a
        CUDA graph (scheduler/runner/decode_graphs.py), which cannot wait for the counts that
        grouping needs; it reads every expert's weights, so only graph replays of decodes
        take it."""
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            weight = (weights * (ids == index)).sum(dim=-1, keepdim=True)
            out = out + expert(x) * weight
        return out
