"""6-bit linear layers for the CPU: GGUF's Q6_K (w = d c (q - 32), q in 0..63, an int8 c
per sub-block of 16 and a d per super-block of 256) held exactly in 6.625 bits a weight, on
the C kernel (model/native/int6_matmul.c).

A Q4_K_M file keeps half its down projections and its output projection in Q6_K, which
grouped int8 held in 9 bits and only within a sixteenth of a step: for Qwen2.5-Coder-1.5B
those are 0.48 GB of grouped int8 a decode step reads, 0.35 GB here, exactly as the file
has them.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType

from model.checkpoint.dequant import q6_k_grid
from model.checkpoint.file_blocks import FileBlocks
from model.errors import UnsupportedFormatError
from model.native.huge_pages import empty_on_huge_pages
from model.native.int6_a8 import NativeInt6A8Logits, NativeInt6A8Matmul
from model.native.ops import NativeInt6Logits, NativeInt6Matmul, int6_grid
from model.quant.base import QuantizedLinear

logger = logging.getLogger(__name__)

SUPER_BLOCK = 256
SUB_BLOCK_BYTES = 208  # 16 x 16 weights' six bits and the sub-block's 16 c


class Int6Linear(QuantizedLinear):
    """Q6_K's own format on the C kernel; bf16 output, or fp32 with `logits` (the output
    projection). Each super-block of 256 input columns is found on its Q6_K grid, so it
    loads without loss; a super-block on no such grid is rounded, and the load says how
    many were. `int8_activations` rounds each row of x to int8 in groups of 32 first
    (int6_matmul_a8.c, as llama.cpp computes a Q6_K layer), on the same packed bytes."""

    scale_dtype = torch.float32
    block_types = frozenset({GGMLQuantizationType.Q6_K})

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        logits: bool = False,
        int8_activations: bool = False,
    ) -> None:
        if in_features % SUPER_BLOCK or out_features % 16:
            raise UnsupportedFormatError(
                f"6-bit super-blocks need in_features divisible by {SUPER_BLOCK} and "
                f"out_features by 16, got [{out_features}, {in_features}]"
            )
        super().__init__(in_features, out_features, device)
        self.logits = logits
        self.int8_activations = int8_activations
        self._native: NativeInt6Matmul | None = None
        self._rounded = 0
        # Rows found on their grid (q, c, d) but not yet packed, by first row.
        self._pending: dict[int, tuple[torch.Tensor, ...]] = {}
        self._packed_rows = 0
        self.register_buffer("scales", torch.empty(0, dtype=torch.float32, device=device))
        self.register_buffer("weight_int6", torch.empty(0, dtype=torch.uint8, device=device))

    def _new_staging(self) -> torch.Tensor:
        """The kernel's own buffers, filled tile by tile as rows come in (`_stage`): packed
        from a copy of the whole layer, a vocabulary's weight was held twice while
        loading (0.19 GB more for Qwen2.5-Coder-1.5B's output projection)."""
        self._native = _kernel(self.int8_activations, self.logits)
        self.weight_int6 = empty_on_huge_pages(
            (self.out_features * self.in_features * 13 // 16,), torch.uint8, "cpu"
        )
        self.scales = torch.empty(
            self.out_features * self.in_features // SUPER_BLOCK, dtype=torch.float32
        )
        return self.weight_int6

    def _stage(self, row: int, weight: torch.Tensor) -> None:
        q, c, d, rounded = int6_grid(weight)
        self._rounded += rounded
        self._stage_grid(row, q, c, d)

    def _stage_blocks(self, row: int, weight: FileBlocks) -> None:
        q, c, d = q6_k_grid(weight.blocks())
        rows = weight.shape[0]
        self._stage_grid(row, q.reshape(rows, -1), c.reshape(rows, -1), d.reshape(rows, -1))

    def _stage_grid(self, row: int, q: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> None:
        """w = d c (q - 32): q uint8 [rows, in], c int8 [rows, in / 16], d fp32 [rows, in / 256]."""
        self._pending[row] = (q, c, d)
        # The run of rows from the first unpacked one, packed in whole tiles of 16 rows
        # (their bytes are contiguous); rows after the last whole tile wait for the next.
        run, at = [], self._packed_rows
        while at in self._pending:
            run.append(self._pending.pop(at))
            at += len(run[-1][0])
        if not run:
            return
        q, c, d = (
            torch.cat(parts) if len(run) > 1 else parts[0] for parts in zip(*run, strict=True)
        )
        whole = len(q) // 16 * 16
        if whole:
            first = self._packed_rows * self.in_features
            weight_bytes = self.weight_int6[
                first * 13 // 16 : (first + whole * self.in_features) * 13 // 16
            ]
            scales = self.scales[
                first // SUPER_BLOCK : (first + whole * self.in_features) // SUPER_BLOCK
            ]
            self._native.pack(q[:whole], c[:whole], d[:whole], weight_bytes, scales)
            self._packed_rows += whole
        if whole < len(q):
            self._pending[self._packed_rows] = (q[whole:], c[whole:], d[whole:])

    def _pack(self) -> None:
        if self._packed_rows != self.out_features:
            raise RuntimeError(
                f"int6 layer: {self._packed_rows} of {self.out_features} rows packed"
            )
        if self._rounded:
            total = self.out_features * self.in_features // SUPER_BLOCK
            logger.warning(
                "int6 layer [%d, %d]: %d of %d super-blocks were on no Q6_K grid and were rounded",
                self.out_features,
                self.in_features,
                self._rounded,
                total,
            )

    def use_int8_activations(self, on: bool) -> None:
        """Switches between the C kernels with bf16 and with int8 activations, which read
        the same packed bytes: the activation probe (model/plan/activation_probe.py) tries
        a loaded model both ways."""
        self.int8_activations = on
        if self._native is not None:
            self._native = _kernel(on, self.logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first_outputs(x, self.out_features)

    def first_outputs(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The first n outputs: the tiles of 16 that hold them are a prefix of the bytes."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        tiled = -(-n // 16) * 16
        weight = self.weight_int6[: tiled * self.in_features * 13 // 16]
        scales = self.scales[: tiled * self.in_features // SUPER_BLOCK]
        out = self._native(flat, weight, scales, tiled)[:, :n]
        if not self.logits:  # the logits stay fp32, as the model's head gives them
            out = out.to(x.dtype)
        return out.reshape(*x.shape[:-1], n)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight in `dtype`, read from the kernel's layout
        (int6_matmul.c): a tied embedding's lookup."""
        flat = ids.reshape(-1)
        n, supers = len(flat), self.in_features // SUPER_BLOCK
        tile, column, index = flat // 16, flat % 16, torch.arange(len(flat))
        blocks = self.weight_int6.view(-1, supers, 16, SUB_BLOCK_BYTES)[tile].to(torch.int32)
        # [n, supers, sub-block, step, e]: nibbles; the top bits of steps 2u and 2u + 1
        # share a byte, four bits each.
        nibbles = blocks[..., :128].reshape(n, supers, 16, 4, 16, 2)[index, :, :, :, column]
        tops = blocks[..., 128:192].reshape(n, supers, 16, 2, 16, 2)[index, :, :, :, column]
        tops = torch.stack([tops, tops >> 4], dim=4).reshape(n, supers, 16, 4, 2)
        low = (nibbles & 15) | (tops & 3) << 4
        high = (nibbles >> 4) | ((tops >> 2) & 3) << 4
        q = torch.stack([low, high], dim=4).reshape(n, supers, 16, 16)  # K: 4 s + 2 h + e
        c = blocks[..., 192:208].reshape(n, supers, 16, 16)[index, :, :, column].to(torch.int8)
        d = self.scales.view(-1, supers, 16)[tile, :, column]
        rows = (q - 32).float() * (d[..., None] * c.float())[..., None]
        return rows.reshape(*ids.shape, self.in_features).to(dtype)


def _kernel(int8_activations: bool, logits: bool) -> NativeInt6Matmul:
    kernels = (
        (NativeInt6A8Matmul, NativeInt6A8Logits)
        if int8_activations
        else (NativeInt6Matmul, NativeInt6Logits)
    )
    return kernels[logits]()


def on_grid(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight on Q6_K's grid, as a Q6_K file's dequantised values are."""
    q = torch.randint(0, 64, (out_features, in_features), generator=generator)
    c = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator)
    d = torch.rand(out_features, in_features // SUPER_BLOCK, generator=generator) * 1e-3
    d = d.half().float()  # as Q6_K stores it: d c is then exact in fp32
    scale = (d.repeat_interleave(SUPER_BLOCK // 16, dim=1) * c).repeat_interleave(16, dim=1)
    return (q - 32) * scale
