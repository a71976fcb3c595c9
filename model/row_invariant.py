"""Float32 products whose rows do not depend on how many rows share them, for
`--batch-invariant`.

PyTorch's float32 matrix product on the CPU (MKL) picks its kernel by the number of rows:
on a 2-core AVX-512 EPYC a row comes out in other bits when the product has 1, 2, 3, 5,
6, 7, 9, 10 or 11 rows than when it has 4, 8 or 12 and more (every shape of the default
model, up to 300 rows checked). A decode of one sequence, the same token verified among a
speculating sequence's guesses and a crowded step then give logprobs that differ by up to
3e-5. Here a product of few rows is padded with zero rows to a count whose rows are those
of any larger product: the smallest such count at or above it, found for each weight
shape on first use by comparing products of 1 to `PROBE_ROWS` rows with one of
`PROBE_ROWS`, so a CPU whose library blocks otherwise is measured, not assumed. Counts
from `PROBE_ROWS` up are taken as they come. Padding costs a one-row decode of the default
model in float32 about 40% (a matrix-vector product becomes a product of four rows), which
is why only `--batch-invariant` asks for it; its quantised layers run on the C kernels,
which compute each row alone anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = 32


# Per weight shape and bias or none: for each count of rows below PROBE_ROWS, the count to
# compute them as.
_COUNTS: dict[tuple[int, int, bool], tuple[int, ...]] = {}


def _probe(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """Probed as the layer computes (with a bias the product is another call)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator)
    with torch.no_grad():
        reference = F.linear(x, weight, bias)
        agree = [
            m
            for m in range(1, PROBE_ROWS)
            if torch.equal(F.linear(x[:m], weight, bias), reference[:m])
        ]
    agree.append(PROBE_ROWS)
    return (0, *(min(a for a in agree if a >= m) for m in range(1, PROBE_ROWS)))


def row_count(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> int:
    """The number of rows to compute `rows` rows of this product as: probed once a shape
    and process, on the first weight of that shape (the kernel, not the values, decides)."""
    if rows >= PROBE_ROWS:
        return rows
    key = (weight.shape[0], weight.shape[1], bias is not None)
    if key not in _COUNTS:
        _COUNTS[key] = _probe(weight, bias)
    return _COUNTS[key][rows]


class RowInvariantLinear(nn.Linear):
    """nn.Linear whose float32 rows are computed as in a product of any larger batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        count = row_count(self.weight, self.bias, rows)
        if count == rows:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(count - rows, flat.shape[1])])
        out = F.linear(padded, self.weight, self.bias)[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def sharing(cls, linear: nn.Linear) -> RowInvariantLinear:
        """One that holds `linear`'s own parameters (a tied output projection stays tied)."""
        bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, bias=bias, device="meta")
        module.weight, module.bias = linear.weight, linear.bias
        return module


def make_rows_invariant(model: nn.Module) -> int:
    """Every float32 nn.Linear of `model` on the CPU becomes a RowInvariantLinear, and the C
    paged attention takes every float32 query of a prefill as it takes a decode's, so a
    row's attention does not depend on where its prompt was cut into chunks. Returns how
    many linear layers changed."""
    changed = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(owner, name, RowInvariantLinear.sharing(child))
                changed += 1
    attention = getattr(model, "attention", None)
    if attention is not None and hasattr(attention, "every_query_alone"):
        attention.every_query_alone = True
    return changed
