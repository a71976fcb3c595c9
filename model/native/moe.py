"""A mixture of experts' experts for one step in one C call (moe_experts.c): the step's
token slots grouped by expert, each chosen expert run once over its rows (gpt-oss's with
their biases and clamped gate), the weighted outputs summed per token and added to the
residual. The router stays in PyTorch
(model/network/moe.py): a [rows, n_experts] product and a top-k, a few ops a layer, and
its choice of experts is then exactly the PyTorch path's.

On 2 cores the PyTorch path's ~10 small ops per chosen expert (gathers, chunks, SiLU,
weights, the scatter back) and two OpenMP regions per expert cost more than the experts'
products at one stream; here a layer's experts are one call and, with enough experts in
the step, one OpenMP region.
"""

from __future__ import annotations

import ctypes

import torch

from model.native.build import load_library
from model.native.layer import NativeWeight, WeightStruct

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
    ]


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
    ) -> None:
        """gpt-oss: `biases`, every expert's gate/up and down biases stacked (bf16,
        [n_experts, 2 ffn] and [n_experts, dim]), and the gate's `limit` and `alpha`."""
        self._call = load_library().moe_experts_bf16
        self._call.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
        self._call.restype = ctypes.c_int
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
        self.dim = dim

    def add(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        """x [T, dim] the normalised rows, h [T, dim] the residual, both contiguous bf16;
        ids [T, k] int64 and weights [T, k] bf16, the router's. Returns h plus the experts'
        weighted outputs."""
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty_like(h)
        status = self._call(
            ctypes.addressof(self._struct),
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
