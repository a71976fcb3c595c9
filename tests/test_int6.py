"""int6 (model/quant/int6.py, model/native/int6_matmul.c, int6_grid.c): GGUF Q6_K blocks,
random bytes dequantised by the `gguf` package (llama.cpp's dequantiser in Python), load
without loss; the C kernel at every instruction level the machine executes equals
`F.linear` in fp32 on the same weights to its output's rounding, a row alone as in any
batch; a tied embedding's rows come back bit for bit."""

import logging

import pytest
import torch
import torch.nn.functional as F

from model.native.ops import NativeInt6Logits, NativeInt6Matmul
from model.quant.int6 import Int6Linear
from tests.native_builds import ISAS, kernel_build, library_at
from tests.q6_k import random_weight

SHAPES = [(512, 96), (256, 48), (1024, 16)]  # (in, out); 48: an odd count of tiles
# Around the blocks of 8 rows; from 16, blocks of two tiles; from 32, each pair of tiles
# unpacked once for all the blocks.
ROWS = [1, 7, 8, 9, 17, 33]


def q6_k_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_weight(out_features, in_features, seed).copy())


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module", params=ISAS)
def isa(request) -> str:
    return request.param


def test_q6_k_blocks_are_found_on_their_own_grid(caplog) -> None:
    weight = q6_k_weight(64, 1024)
    weight[3, :256] = 0  # a zero super-block, and a zero sub-block
    weight[5, 16:32] = 0
    layer = Int6Linear(1024, 64, "cpu", logits=True)
    with caplog.at_level(logging.WARNING):
        layer.load_rows(0, weight)
    assert "rounded" not in caplog.text
    assert layer.weight_int6.numel() == 64 * 1024 * 13 // 16  # 6.5 bits, then d
    ids = torch.tensor([[5, 0, 63], [3, 17, 5]])
    assert torch.equal(layer.embed(ids, torch.float32), weight[ids])  # bit for bit


def test_weights_on_no_grid_are_rounded_and_the_load_says_so(caplog) -> None:
    weight = torch.randn(32, 512, generator=torch.Generator().manual_seed(0))
    layer = Int6Linear(512, 32, "cpu", logits=True)
    with caplog.at_level(logging.WARNING):
        layer.load_rows(0, weight)
    assert "64 of 64 super-blocks" in caplog.text
    rows = layer.embed(torch.arange(32), torch.float32)
    # Each sub-block's step is its largest magnitude over 31, to the int8 c's rounding.
    assert relative_error(rows, weight) < 0.02


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("logits", [False, True])
def test_matches_fp32_on_the_q6_k_weights(isa, in_features, out_features, logits) -> None:
    weight = q6_k_weight(out_features, in_features, seed=in_features)
    layer = Int6Linear(in_features, out_features, "cpu", logits=logits)
    layer.load_rows(0, weight)  # every level's layout is the same (test_every_level_packs_alike)
    kernel = kernel_build(NativeInt6Logits if logits else NativeInt6Matmul, isa)
    generator = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, layer.weight_int6, layer.scales, out_features)
        assert y.dtype == (torch.float32 if logits else torch.bfloat16)
        assert y.shape == (rows, out_features)
        # fp32 sums in another order leave ~1e-7, the bf16 output's rounding ~1.7e-3; a
        # lost weight would leave far more.
        assert relative_error(y, F.linear(x.float(), weight)) < (1e-5 if logits else 4e-3)


@pytest.mark.parametrize("logits", [False, True])
def test_a_row_alone_equals_it_in_a_batch(isa, logits) -> None:
    layer = Int6Linear(512, 96, "cpu", logits=logits)
    layer.load_rows(0, q6_k_weight(96, 512, seed=2))
    kernel = kernel_build(NativeInt6Logits if logits else NativeInt6Matmul, isa)
    generator = torch.Generator().manual_seed(3)
    # Values over many octaves, so that float32 sums round and their order shows.
    x = torch.randn(33, 512, generator=generator)
    x = (x * torch.exp2(torch.randint(-12, 12, x.shape, generator=generator))).bfloat16()
    w, scales = layer.weight_int6, layer.scales
    alone = [kernel(x[row : row + 1].clone(), w, scales, 96)[0] for row in range(33)]
    # Blocks of every size; tile pairs from 16 rows (8 for logits with AVX-512 BF16),
    # unpacked once for all blocks from 32.
    for rows in (*range(2, 10), 16, 17, 33):
        batch = kernel(x[:rows].clone(), w, scales, 96)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)


def test_every_level_packs_alike() -> None:
    q = torch.randint(0, 64, (48, 512), dtype=torch.uint8)
    c = torch.randint(-128, 128, (48, 32), dtype=torch.int8)
    d = torch.rand(48, 2)
    packed = [NativeInt6Matmul(library_at(isa)).pack(q, c, d) for isa in ISAS]
    for weight, tiled in packed[1:]:
        assert torch.equal(weight, packed[0][0]) and torch.equal(tiled, packed[0][1])


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_rows_loaded_in_parts_equal_rows_loaded_at_once(order) -> None:
    """Parts of any size, as a file's blocks of rows come (packed a whole tile of 16 rows
    at a time as soon as its rows are in), in order or not."""
    weight = q6_k_weight(96, 256, seed=4)
    whole = Int6Linear(256, 96, "cpu")
    whole.load_rows(0, weight)
    parts = Int6Linear(256, 96, "cpu")
    bounds = [0, 5, 32, 59, 60, 96]
    pieces = list(zip(bounds[:-1], bounds[1:], strict=True))
    for first, end in pieces if order == "in order" else pieces[::-1]:
        parts.load_rows(first, weight[first:end])
    assert parts.ready and not parts._pending
    assert torch.equal(whole.weight_int6, parts.weight_int6)
    assert torch.equal(whole.scales, parts.scales)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(whole(x), parts(x))


def test_shapes_off_the_super_block_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 256"):
        Int6Linear(896, 64, "cpu")


def test_int6_against_grouped_int8_is_timed_on_one_thread(monkeypatch) -> None:
    """Both kernels split their tiles among threads alike: their ratio is taken on one
    thread, which a busy second core cannot stretch, and the team is given back after; so
    is int6 with bf16 against int8 activations (model/plan/int6_activations.py)."""
    from model.plan import int6_activations, layer_formats, timing

    seen = []

    def timed(run, reps=5):
        seen.append(torch.get_num_threads())
        run()
        return 1.0

    monkeypatch.setattr(timing, "best_thread_ms", timed)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert layer_formats.int6_and_int8g_ms(256, 32, logits=True) == (1.0, 1.0)
        assert int6_activations.int6_activations_ms(256, 32, logits=False) == (1.0, 1.0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    # Two products at each of the three batch sizes, per comparison, all on one thread.
    assert seen == [1] * 12
    assert seen and set(seen) == {1}
