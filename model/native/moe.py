"""A mixture of experts' experts for one step in one C call (moe_experts.c): the step's
token slots grouped by expert, each chosen expert run once over its rows (gpt-oss's with
their biases and clamped gate), the weighted outputs summed per token and added to the
residual. With `MoeRouter`, the post-attention norm and the router too (moe_router.c):
the C decoder layer then runs the whole FFN after attention, one call a layer
(`pointer`), where the PyTorch router's ~10 ops a layer cost more than its product.

On 2 cores the PyTorch path's ~10 small ops per chosen expert (gathers, chunks, SiLU,
weights, the scatter back) and two OpenMP regions per expert cost more than the experts'
products at one stream; here a layer's experts are one call and, with enough experts in
the step, one OpenMP region.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from model.native.build import load_library
from model.native.layer_weight import NativeWeight, WeightStruct

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _MoeExperts(ctypes.Structure):
    """moe_experts.c's `moe_experts`: same fields, same order."""

    _fields_ = [
        ("gate_up", _PTR),
        ("down", _PTR),
        ("n_experts", _I64),
        ("top_k", _I64),
        ("dim", _I64),
        ("ffn", _I64),
        ("gate_up_bias", _PTR),
        ("down_bias", _PTR),
        ("limit", ctypes.c_float),
        ("alpha", ctypes.c_float),
        ("norm", _PTR),
        ("router", _PTR),
        ("router_bias", _PTR),
        ("eps", ctypes.c_float),
        ("norm_topk", _I64),
    ]


@dataclass(frozen=True)
class MoeRouter:
    """What the C call routes with (all bf16, contiguous): the post-attention RMSNorm's
    weight and eps, the router's weight [n_experts, dim] and gpt-oss's bias, and whether
    the top k weights are renormalised."""

    norm: torch.Tensor
    eps: float
    weight: torch.Tensor
    bias: torch.Tensor | None
    norm_topk: bool


class NativeMoeExperts:
    """Holds one layer's expert weight pointers: `gate_up` and `down`, one NativeWeight per
    expert, in expert order."""

    def __init__(
        self,
        gate_up: list[NativeWeight],
        down: list[NativeWeight],
        top_k: int,
        dim: int,
        ffn: int,
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,
        limit: float | None = None,
        alpha: float = 1.702,
        router: MoeRouter | None = None,
    ) -> None:
        """gpt-oss: `biases`, every expert's gate/up and down biases stacked (bf16,
        [n_experts, 2 ffn] and [n_experts, dim]), and the gate's `limit` and `alpha`.
        With `router`, `layer` and `route` run too."""
        library = load_library()
        self._call = library.moe_experts_bf16
        self._call.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
        self._call.restype = ctypes.c_int
        self._layer = library.moe_layer_bf16
        self._layer.argtypes = [_PTR, _PTR, _I64, _PTR]
        self._layer.restype = ctypes.c_int
        self._route = library.moe_route_bf16
        self._route.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR]
        self._route.restype = ctypes.c_int
        # The tensors are referenced here, so the pointers below stay valid.
        self._tensors = [t for weight, scales, _ in (*gate_up, *down) for t in (weight, scales)]
        self._gate_up = (WeightStruct * len(gate_up))(
            *(WeightStruct(w.data_ptr(), s.data_ptr(), kind) for w, s, kind in gate_up)
        )
        self._down = (WeightStruct * len(down))(
            *(WeightStruct(w.data_ptr(), s.data_ptr(), kind) for w, s, kind in down)
        )
        self._struct = _MoeExperts(
            ctypes.addressof(self._gate_up),
            ctypes.addressof(self._down),
            len(gate_up),
            top_k,
            dim,
            ffn,
            *(b.data_ptr() for b in biases) if biases else (None, None),
            limit or 0.0,
            alpha,
        )
        self._tensors += list(biases or ())
        self.dim, self.top_k = dim, top_k
        self.router = router
        if router is not None:
            parts = [router.norm, router.weight, router.bias]
            assert all(
                t.dtype == torch.bfloat16 and t.is_contiguous() for t in parts if t is not None
            )
            self._tensors += [t for t in parts if t is not None]
            self._struct.norm, self._struct.router = (
                router.norm.data_ptr(),
                router.weight.data_ptr(),
            )
            self._struct.router_bias = router.bias.data_ptr() if router.bias is not None else None
            self._struct.eps, self._struct.norm_topk = router.eps, router.norm_topk
        self.pointer = ctypes.addressof(self._struct)

    def add(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        """x [T, dim] the normalised rows, h [T, dim] the residual, both contiguous bf16;
        ids [T, k] int64 and weights [T, k] bf16, the router's. Returns h plus the experts'
        weighted outputs."""
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty_like(h)
        status = self._call(
            self.pointer,
            x.data_ptr(),
            x.shape[0],
            ids.data_ptr(),
            weights.data_ptr(),
            h.data_ptr(),
            out.data_ptr(),
        )
        if status == 1:
            raise ValueError("mixture of experts: the router chose an expert out of range")
        if status:
            raise MemoryError("mixture of experts: out of memory for its buffers")
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] contiguous bf16, the normalised rows: (weights [T, k] bf16, expert ids
        [T, k]) as the C router picks them; needs `router`."""
        assert self.router is not None
        ids = torch.empty(x.shape[0], self.top_k, dtype=torch.int64)
        weights = torch.empty(x.shape[0], self.top_k, dtype=torch.bfloat16)
        status = self._route(
            self.pointer, x.data_ptr(), x.shape[0], ids.data_ptr(), weights.data_ptr()
        )
        if status:
            raise MemoryError("mixture of experts: out of memory for the router's buffers")
        return weights, ids

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, dim] contiguous bf16, the residual after attention: h plus the experts'
        output for the post-attention norm of h, routed in C; needs `router`."""
        assert self.router is not None
        out = torch.empty_like(h)
        if self._layer(self.pointer, h.data_ptr(), h.shape[0], out.data_ptr()):
            raise MemoryError("mixture of experts: out of memory for its buffers")
        return out
