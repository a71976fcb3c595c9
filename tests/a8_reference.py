"""The check every kernel with int8 activations passes (w6a8, w8a8): against the weights as
the `gguf` package dequantises them times the activations rounded to int8 here,
independently, in float64."""

from collections.abc import Callable, Sequence

import torch

from tests.test_int4_a8_kernel import quantised_activations
from tests.test_int6 import relative_error

ROWS = [1, 7, 8, 9, 17]


def assert_matches_quantised_product(
    product: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    logits: bool,
    fp32_bound: float,
    rows_tried: Sequence[int] = ROWS,
) -> None:
    """fp32 output (logits) within `fp32_bound` of the quantised product (exact integer sums,
    fp32 scaling; an activation rounded the other way at a tie), bf16 output within 4e-3;
    both off the exact product by about what rounding x to 8 bits costs (~5e-3)."""
    generator = torch.Generator().manual_seed(5)
    for rows in rows_tried:
        x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
        y = product(x)
        assert y.dtype == (torch.float32 if logits else torch.bfloat16)
        expected = quantised_activations(x) @ weight.double().T
        assert relative_error(y.double(), expected) < (fp32_bound if logits else 4e-3), rows
        assert 1e-4 < relative_error(y.double(), x.double() @ weight.double().T) < 1.5e-2
