"""The kernels' batch-invariance check: each row of x, multiplied alone, gives the same bits
as inside batches of several sizes, since a request's tokens must not depend on its
neighbours in a step."""

from collections.abc import Callable, Iterable

import torch


def assert_rows_alone_equal_batches(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batches: Iterable[int]
) -> None:
    """`product(rows of x)` for each row alone against the first `n` rows for each `n`."""
    alone = [product(x[row : row + 1].clone())[0] for row in range(x.shape[0])]
    for rows in batches:
        batch = product(x[:rows].clone())
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)


def scattered_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows whose values span 24 binades, so a changed summation order shows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    return (x * torch.exp2(torch.randint(-12, 12, x.shape, generator=generator))).bfloat16()
