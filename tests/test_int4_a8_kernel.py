"""The C int4 matmul with int8 activations (model/native/int4_matmul_a8.c), built for
every instruction level the machine executes (AVX-512 VNNI where the level has it, the
portable loop at the others), against the
same weights dequantised and the activations quantised here, independently, as the
kernel documents (groups of 32, scale max |x| / 127, round to nearest even), multiplied
in float64."""

import pytest
import torch

import model.plan.int4_kernel as int4_kernel
from model.native.ops import NativeInt4A8Matmul, NativeInt4Matmul
from model.quant.base import INT4_GROUP
from model.quant.int4 import Int4Linear
from tests.native_builds import ISAS, kernel_build
from tests.test_int4_kernel import (
    ROWS,
    SHAPES,
    assert_a_row_alone_equals_it_in_a_batch,
    dequantised,
    random_int4,
    relative_error,
)


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per row in groups of 32 and scaled back, in float64."""
    rows, width = x.shape
    groups = x.float().reshape(rows, width // INT4_GROUP, INT4_GROUP)
    top = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(groups * inverse)
    assert q.abs().max() <= 127
    return (q.double() * (top.double() / 127.0)).reshape(rows, width)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: quantised x times (q - 8) * scale, plus the
    zeros times the sums of x itself."""
    weight = dequantised(q, scales).double()
    zero = scales[..., 1].double().T.repeat_interleave(INT4_GROUP, dim=1)
    return quantised_activations(x) @ (weight - zero).T + x.double() @ zero.T


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> NativeInt4A8Matmul:
    return kernel_build(NativeInt4A8Matmul, request.param)


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_the_quantised_product_in_float64(kernel, in_features, out_features) -> None:
    q, scales, generator = random_int4(in_features, out_features)
    weight, tiled = NativeInt4Matmul.pack(q, scales)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, weight, tiled, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        expected = reference(x, q, scales)
        # bf16 output rounding alone leaves ~1.7e-3; rounding x to 8 bits ~6e-3 more.
        assert relative_error(y.double(), expected) < 4e-3, rows
        exact = x.double() @ dequantised(q, scales).double().T
        assert relative_error(y.double(), exact) < 1.5e-2, rows


def test_all_zero_groups_give_zero(kernel) -> None:
    q, scales, _ = random_int4(64, 32)
    weight, tiled = NativeInt4Matmul.pack(q, scales)
    assert torch.equal(
        kernel(torch.zeros(3, 64).bfloat16(), weight, tiled, 32), torch.zeros(3, 32).bfloat16()
    )


def test_a_row_alone_equals_it_in_a_batch(kernel) -> None:
    assert_a_row_alone_equals_it_in_a_batch(kernel)


def test_the_layer_runs_on_it_with_the_weight_held_once() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(960, 576, generator=generator) * 0.05
    x = torch.randn(9, 576, generator=generator)
    outputs = {}
    for name in ("native", "native_a8"):
        layer = Int4Linear(576, 960, "cpu", kernel=name)
        layer.load_rows(0, weight)
        assert layer.weight_int4.numel() * layer.weight_int4.element_size() == 960 * 576 // 2
        outputs[name] = layer(x).float()
    assert 1e-4 < relative_error(outputs["native_a8"], outputs["native"]) < 1.5e-2


def test_int4_is_weight_only_and_w4a8_rounds_the_activations(monkeypatch, tmp_path) -> None:
    """`--quantization int4` keeps bf16 activations even where int8 ones would be faster;
    `w4a8` asks for them."""
    from model.loader import load_model
    from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path)
    int4_kernel._choose_on_cpu.cache_clear()
    timings = {"native": 2.0, "native_a8": 1.0, "torch": 3.0}
    monkeypatch.setattr(
        int4_kernel, "_time_kernels", lambda _in, _out, allowed: {k: timings[k] for k in allowed}
    )
    for quantization, expected in (("int4", "native"), ("w4a8", "native_a8")):
        model = load_model(tmp_path, dtype="bfloat16", quantization=quantization, progress=False)
        layers = [m for m in model.model.modules() if isinstance(m, Int4Linear)]
        assert {m.kernel for m in layers} == {expected}, quantization
    int4_kernel._choose_on_cpu.cache_clear()
