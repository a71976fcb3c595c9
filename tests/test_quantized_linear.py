"""Tests for model/quant/: each weight-only format against its fp32 twin (the
same weights through `F.linear`), rows loaded in any order, and the exact requantisation of
GGUF Q4_1-style groups."""

import pytest
import torch
import torch.nn.functional as F

from model.errors import UnsupportedFormatError
from model.quant.base import INT4_GROUP
from model.quant.factory import quantized_linear
from model.quant.file_grid import file_grid
from model.quant.int4 import Int4Linear
from model.quant.int8 import Int8Linear

SHAPES = [(576, 960), (1536, 576), (64, 96)]  # (in, out): SmolLM2's QKV and down; tiny


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize(
    ("quantization", "tolerance"), [("int8", 0.02), ("int8g", 0.01), ("int4", 0.12)]
)
def test_matches_its_fp32_twin(quantization, tolerance, in_features, out_features) -> None:
    # Gaussian weights are the hard case for 4 bits: 16 levels over each group's range
    # leave ~8% relative error; int8 per row leaves ~1%.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(5, in_features, generator=generator)
    layer = quantized_linear(quantization, in_features, out_features, "cpu")
    layer.load_rows(0, weight)
    assert relative_error(layer(x), F.linear(x, weight)) < tolerance


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_rows_in_any_order_give_the_same_layer(cls) -> None:
    weight = torch.randn(96, 64) * 0.05
    whole, parts = cls(64, 96, "cpu"), cls(64, 96, "cpu")
    whole.load_rows(0, weight)
    for row in (64, 0, 32):  # V, Q, K of a fused projection, out of order
        assert not parts.ready
        parts.load_rows(row, weight[row : row + 32])
    assert parts.ready
    x = torch.randn(3, 64)
    assert torch.equal(whole(x), parts(x))


def test_q4_1_groups_requantise_without_loss() -> None:
    # w = d * q + m with q spanning 0..15 in each group of 32, as a GGUF Q4_1 block stores it.
    generator = torch.Generator().manual_seed(1)
    out_features, in_features = 32, 128
    groups = in_features // INT4_GROUP
    q = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 0.001
    m = -8 * d + torch.randn(out_features, groups, 1, generator=generator) * 0.001
    # Scales and zeros that bf16 holds exactly, so that only the kernel's rounding is left.
    d, m = d.bfloat16().float(), m.bfloat16().float()
    weight = (d * q + m).reshape(out_features, in_features)
    layer = Int4Linear(in_features, out_features, "cpu")
    layer.load_rows(0, weight)
    x = torch.randn(4, in_features, generator=generator)
    reference = F.linear(x.bfloat16().float(), weight)
    assert relative_error(layer(x), reference) < 0.01  # bf16 activations and output only


def test_groups_on_a_grid_that_leaves_its_ends_unused_requantise_without_loss() -> None:
    # w = d * q + m with q in 3..12 only: Q4_K's quantiser often leaves a sub-block's ends
    # unused. Spread over its own min-to-max span in 15 steps, such a group moved by ~4%.
    generator = torch.Generator().manual_seed(2)
    out_features, in_features = 32, 128
    groups = in_features // INT4_GROUP
    q = torch.randint(3, 13, (out_features, groups, INT4_GROUP), generator=generator)
    q[..., 0], q[..., 1], q[..., 2] = 3, 12, 4
    d = (torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 0.001).bfloat16()
    m = -8 * d.float() + torch.randn(out_features, groups, 1, generator=generator) * 1e-3
    weight = (d.float() * q + m.bfloat16().float()).reshape(out_features, in_features)
    layer = Int4Linear(in_features, out_features, "cpu")
    layer.load_rows(0, weight)
    x = torch.randn(4, in_features, generator=generator)
    reference = F.linear(x.bfloat16().float(), weight)
    assert relative_error(layer(x), reference) < 0.01


@pytest.mark.parametrize(
    "levels", [tuple(range(16)), tuple(range(3, 13)), (0, 11, 15), (0, 3, 15), (2, 6, 10)]
)
def test_a_group_on_a_4_bit_grid_is_found_on_it(levels) -> None:
    """Whatever levels of 16 a group uses: all of them, its ends unused, the two ends and
    one inside (found on its span over 15 only: its smallest gap is four steps), or
    evenly spaced ones (found on their own coarser grid)."""
    generator = torch.Generator().manual_seed(3)
    picks = torch.randint(0, len(levels), (64, 2, INT4_GROUP), generator=generator)
    picks[..., : len(levels)] = torch.arange(len(levels))  # every level present
    q = torch.tensor(levels)[picks].float()
    d = torch.rand(64, 2, 1, generator=generator) * 0.01 + 0.001
    m = torch.randn(64, 2, 1, generator=generator) * 0.01
    groups = d * q + m
    low = groups.amin(dim=-1, keepdim=True)
    found, step = file_grid(groups, low)
    assert found.all()
    rebuilt = low + step * ((groups - low) / step).round()
    assert (rebuilt - groups).abs().max() < 1e-6 * groups.abs().max()


def test_rows_that_do_not_fit_are_refused() -> None:
    layer = Int8Linear(64, 96, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(80, torch.zeros(32, 64))
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(0, torch.zeros(32, 48))
    with pytest.raises(UnsupportedFormatError, match="divisible"):
        Int4Linear(60, 96, "cpu")
