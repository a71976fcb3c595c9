"""Per-row int8 linear layers: symmetric int8, one scale per output row, on PyTorch's
packed kernel (`_weight_int8pack_mm`) with bf16 activations. Exact for no GGUF type, so
only taken when asked for (`--quantization int8`)."""

from __future__ import annotations

import torch

from model.quant.base import QuantizedLinear


class Int8Linear(QuantizedLinear):
    """Symmetric int8, one scale per output row."""

    staging_dtype = torch.int8

    def __init__(self, in_features: int, out_features: int, device: torch.device | str) -> None:
        super().__init__(in_features, out_features, device)
        self.register_buffer(
            "scales", torch.empty(out_features, dtype=torch.bfloat16, device=device)
        )
        self.register_buffer("weight_int8", torch.empty(0, dtype=torch.int8, device=device))

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = (weight / scale[:, None]).round().clamp(-127, 127)
        self._staging[row : row + weight.shape[0]] = q.to(torch.int8)
        self.scales[row : row + weight.shape[0]] = scale.to(torch.bfloat16)

    def _pack(self) -> None:
        self.weight_int8 = self._staging

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features)
