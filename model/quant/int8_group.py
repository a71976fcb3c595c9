"""Grouped int8 linear layers for the CPU (model/native/int8_matmul.c): symmetric int8 in
groups of 32 input columns with fp16 scales, GGUF Q8_0's own format. The output
projection's format where the checkpoint stores it in 8 bits or fewer, and a decoder
layer's where a Q4_K_M file mixes wider types into one fused layer ("int8g"); with int8
activations ("w8a8", model/native/int8_matmul_a8.c), either, where a model runs in w4a8."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from model.checkpoint.dequant import q8_0_grid
from model.checkpoint.file_blocks import FileBlocks
from model.errors import UnsupportedFormatError
from model.native.int8_a8 import NativeInt8A8Logits, NativeInt8A8Matmul
from model.native.ops import NativeInt8Matmul
from model.quant.base import INT4_GROUP, QuantizedLinear, fp16_scales


class Int8GroupLinear(QuantizedLinear):
    """Symmetric int8 in groups of 32 input columns, fp16 scales, on the C kernel. It holds
    GGUF's Q8_0 exactly and the 4- to 6-bit types within a sixteenth of their own step,
    and reads half the bytes of a bf16 copy. As the output
    projection it keeps the kernel's fp32 output (the logits); tied, it is the embedding
    too (`embed`), so the vocabulary's weights exist once. As a decoder layer ("int8g")
    its output takes the activations' dtype, the residual stream's. `int8_activations`
    rounds each row of x to int8 in groups of 32 first, on the same packed bytes."""

    staging_dtype = torch.int8
    scale_dtype = torch.float16
    block_types = frozenset({GGMLQuantizationType.Q8_0})

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        fp32_output: bool = True,
        int8_activations: bool = False,
    ) -> None:
        if in_features % INT4_GROUP or out_features % 16:
            raise UnsupportedFormatError(
                f"grouped int8 needs in_features divisible by {INT4_GROUP} and out_features "
                f"by 16, got [{out_features}, {in_features}]"
            )
        super().__init__(in_features, out_features, device)
        self.fp32_output = fp32_output
        self.int8_activations = int8_activations
        self._native: NativeInt8Matmul | None = None
        groups = in_features // INT4_GROUP
        self.register_buffer(
            "scales", torch.empty(out_features, groups, dtype=torch.float16, device=device)
        )
        self.register_buffer("weight_int8", torch.empty(0, dtype=torch.int8, device=device))

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        rows = weight.shape[0]
        groups = weight.reshape(rows, -1, INT4_GROUP)
        scale = fp16_scales(groups.abs().amax(dim=-1, keepdim=True) / 127.0)
        q = (groups / scale.float()).round().clamp(-127, 127)
        self._staging[row : row + rows] = q.reshape(rows, -1).to(torch.int8)
        self.scales[row : row + rows] = scale.squeeze(-1)

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        q, d = q8_0_grid(weight.blocks())
        rows = weight.shape[0]
        self._staging[row : row + rows] = q.reshape(rows, -1)
        self.scales[row : row + rows] = d.reshape(rows, -1)

    def _kernel(self) -> NativeInt8Matmul:
        if not self.int8_activations:
            return NativeInt8Matmul()
        return NativeInt8A8Logits() if self.fp32_output else NativeInt8A8Matmul()

    def _pack(self) -> None:
        self._native = self._kernel()
        self.weight_int8, self.scales = self._native.pack(self._staging, self.scales)

    def use_int8_activations(self, on: bool) -> None:
        """Switches between the C kernels with bf16 and with int8 activations, which read
        the same packed bytes: the activation probe (model/plan/activation_probe.py) tries
        a loaded output projection both ways."""
        self.int8_activations = on
        if self._native is not None:
            self._native = self._kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first_outputs(x, self.out_features)

    def first_outputs(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The first n outputs: the tiles of 16 that hold them are a prefix of the bytes."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        tiled = -(-n // 16) * 16
        weight = self.weight_int8[: tiled * self.in_features]
        scales = self.scales[: tiled * self.in_features // INT4_GROUP]
        out = self._native(flat, weight, scales, tiled)[:, :n]
        if not self.fp32_output:
            out = out.to(x.dtype)
        return out.reshape(*x.shape[:-1], n)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight in `dtype`: the tied embedding's lookup."""
        rows = NativeInt8Matmul.rows(
            self.weight_int8, self.scales, ids.reshape(-1), self.in_features
        )
        return rows.to(dtype).reshape(*ids.shape, self.in_features)
