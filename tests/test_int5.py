"""int5 (model/quant/int5.py, model/native/int5_matmul.c): GGUF Q5_0 weights, quantised by
the `gguf` package (llama.cpp's reference quantiser in Python), load without loss, and the
C kernel at every instruction level the machine executes equals `F.linear` in fp32 on the
same weights to the bf16 output's rounding, a row alone as in any batch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from model.native.ops import NativeInt5Matmul
from model.quant.base import INT4_GROUP
from model.quant.int5 import Int5Linear, _grid_step
from tests.native_builds import ISAS, kernel_build, library_at

SHAPES = [(576, 960), (64, 32), (64, 48)]  # (in, out); 48: an odd count of tiles
# Around the blocks of 8 rows; from 8 (AVX-512) or 16, blocks of two tiles; from 32, each
# pair of tiles unpacked once for all the blocks.
ROWS = [1, 7, 8, 9, 17, 33]


def q5_0_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random weights through a Q5_0 round trip: what a GGUF file's Q5_0 tensor loads as."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType.Q5_0)
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q5_0).copy())


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> NativeInt5Matmul:
    return kernel_build(NativeInt5Matmul, request.param)


def test_q5_0_groups_are_found_on_their_own_grid() -> None:
    groups = q5_0_weight(64, 256).reshape(64, -1, INT4_GROUP)
    # Another quantiser's block whose largest magnitude is not -16 d: only the gaps tell d.
    inner = torch.tensor([-7, 3, 0, 15, -12, 5] * 5 + [1, -1], dtype=torch.float32) * 0.0123
    groups = torch.cat([groups, inner.expand(64, 1, INT4_GROUP)], dim=1)
    step = _grid_step(groups)
    q = (groups / step).round()
    assert q.amin() >= -16 and q.amax() <= 15
    assert torch.equal(q * step, groups)  # bit for bit
    assert (step < 0).any() and (step > 0).any()  # both signs of d occur in Q5_0 blocks


def test_groups_on_no_grid_are_rounded_within_half_a_step() -> None:
    groups = torch.randn(16, 8, INT4_GROUP)
    step = _grid_step(groups)
    q = (groups / step).round().clamp(-16, 15)
    assert (q * step - groups).abs().le(step.abs() / 2 + 1e-7).all()


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_fp32_on_the_q5_0_weights(kernel, in_features, out_features) -> None:
    weight = q5_0_weight(out_features, in_features)
    layer = Int5Linear(in_features, out_features, "cpu")
    layer.load_rows(0, weight)  # every level's layout is the same (test_every_level_packs_alike)
    assert layer.weight_int5.numel() == out_features * in_features * 5 // 8
    generator = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, layer.weight_int5, layer.scales, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        # bf16 output rounding alone leaves ~1.7e-3; a lost weight would leave far more.
        assert relative_error(y, F.linear(x.float(), weight)) < 4e-3, rows


def test_a_row_alone_equals_it_in_a_batch(kernel) -> None:
    layer = Int5Linear(576, 960, "cpu")
    layer.load_rows(0, q5_0_weight(960, 576, seed=2))
    generator = torch.Generator().manual_seed(3)
    # Values over many octaves, so that float32 sums round and their order shows.
    x = torch.randn(33, 576, generator=generator)
    x = (x * torch.exp2(torch.randint(-12, 12, x.shape, generator=generator))).bfloat16()
    w, scales = layer.weight_int5, layer.scales
    alone = [kernel(x[row : row + 1].clone(), w, scales, 960)[0] for row in range(33)]
    # Blocks of every size; tile pairs from 8 or 16 rows, unpacked once for all from 32.
    for rows in (*range(2, 10), 16, 17, 33):
        batch = kernel(x[:rows].clone(), w, scales, 960)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)


def test_every_level_packs_alike() -> None:
    q = torch.randint(0, 32, (48, 96), dtype=torch.uint8)
    scales = torch.rand(48, 3)
    packed = [NativeInt5Matmul(library_at(isa)).pack(q, scales) for isa in ISAS]
    for weight, tiled in packed[1:]:
        assert torch.equal(weight, packed[0][0]) and torch.equal(tiled, packed[0][1])


def test_rows_loaded_in_parts_equal_rows_loaded_at_once() -> None:
    weight = q5_0_weight(64, 128, seed=4)
    whole, parts = Int5Linear(128, 64, "cpu"), Int5Linear(128, 64, "cpu")
    whole.load_rows(0, weight)
    parts.load_rows(32, weight[32:])
    parts.load_rows(0, weight[:32])
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(whole(x), parts(x))
