"""The C int4 matmul (model/native/int4_matmul.c) against the same weights dequantised and
multiplied in fp32 by `F.linear`, built for every instruction level the machine executes
(the AVX-512 BF16 loop where the level has it, the portable loop at the others); and the
per-shape choice between it and PyTorch's."""

import pytest
import torch
import torch.nn.functional as F

import model.plan.int4_kernel as int4_kernel
from model.loader import load_model
from model.native.build import NativeUnavailable
from model.native.ops import NativeInt4Matmul
from model.quant.base import INT4_GROUP
from model.quant.int4 import Int4Linear
from tests.native_builds import ISAS, kernel_build
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

SHAPES = [(576, 960), (1536, 576), (64, 32), (64, 48)]  # (in, out); 48: an odd count of tiles
ROWS = [1, 7, 8, 9, 33]  # around the blocks of 8 rows; from 16, blocks of two tiles


def random_int4(in_features: int, out_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
    groups = in_features // INT4_GROUP
    scales = (torch.rand(groups, out_features, 2, generator=generator) - 0.5) * 0.02
    return q, scales.bfloat16(), generator


def dequantised(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """w = (q - 8) * scale + zero in fp32, each group's scale repeated over its 32 columns."""
    scale = scales_and_zeros[..., 0].float().T.repeat_interleave(INT4_GROUP, dim=1)
    zero = scales_and_zeros[..., 1].float().T.repeat_interleave(INT4_GROUP, dim=1)
    return (q.float() - 8) * scale + zero


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> NativeInt4Matmul:
    return kernel_build(NativeInt4Matmul, request.param)


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_fp32_on_the_dequantised_weights(kernel, in_features, out_features) -> None:
    q, scales, generator = random_int4(in_features, out_features)
    weight, tiled = kernel.pack(q, scales)
    reference_weight = dequantised(q, scales)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, weight, tiled, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        # bf16 output rounding alone leaves ~1.7e-3.
        assert relative_error(y, F.linear(x.float(), reference_weight)) < 4e-3, rows


def assert_a_row_alone_equals_it_in_a_batch(kernel) -> None:
    """Rows in full and partial blocks of 8 against each alone; `kernel` reads
    NativeInt4Matmul's layout."""
    q, scales, generator = random_int4(576, 960)
    weight, tiled = NativeInt4Matmul.pack(q, scales)
    # Values over many octaves, so that float32 sums round and their order shows: with
    # plain randn, sums taken in another order came out equal.
    x = torch.randn(33, 576, generator=generator)
    x = (x * torch.exp2(torch.randint(-12, 12, x.shape, generator=generator))).bfloat16()
    alone = [kernel(x[row : row + 1].clone(), weight, tiled, 960)[0] for row in range(33)]
    for rows in (*range(2, 10), 16, 33):  # blocks of every size; tile pairs from 16 rows
        batch = kernel(x[:rows].clone(), weight, tiled, 960)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)


def test_a_row_alone_equals_it_in_a_batch(kernel) -> None:
    assert_a_row_alone_equals_it_in_a_batch(kernel)


def test_strided_rows_are_read_in_place() -> None:
    kernel = NativeInt4Matmul()
    q, scales, generator = random_int4(64, 32)
    weight, tiled = kernel.pack(q, scales)
    wide = torch.randn(5, 128, generator=generator).bfloat16()
    assert torch.equal(
        kernel(wide[:, :64], weight, tiled, 32), kernel(wide[:, :64].clone(), weight, tiled, 32)
    )


def test_both_int4_layers_agree_and_hold_the_weight_once() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(960, 576, generator=generator) * 0.05
    x = torch.randn(9, 576, generator=generator)
    outputs = {}
    for name in ("native", "torch"):
        layer = Int4Linear(576, 960, "cpu", kernel=name)
        layer.load_rows(0, weight)
        assert layer.weight_int4.numel() * layer.weight_int4.element_size() == 960 * 576 // 2
        assert layer._staging is None
        outputs[name] = layer(x).float()
    assert relative_error(outputs["native"], outputs["torch"]) < 4e-3


def test_the_faster_kernel_is_chosen(monkeypatch) -> None:
    int4_kernel._choose_on_cpu.cache_clear()
    monkeypatch.setattr(int4_kernel, "_time_kernels", lambda *_: {"native": 2.0, "torch": 1.0})
    assert int4_kernel.choose_int4_kernel(64, 32, torch.device("cpu")) == "torch"
    int4_kernel._choose_on_cpu.cache_clear()
    monkeypatch.setattr(int4_kernel, "_time_kernels", lambda *_: {"native": 1.0, "torch": 2.0})
    assert int4_kernel.choose_int4_kernel(64, 32, torch.device("cpu")) == "native"
    kernel = int4_kernel.int4_kernel_for("auto", 64, 32, torch.device("cpu"), ("native", "torch"))
    layer = Int4Linear(64, 32, "cpu", kernel)
    layer.load_rows(0, torch.randn(32, 64))
    assert layer.kernel == "native"
    int4_kernel._choose_on_cpu.cache_clear()


def test_no_compiler_falls_back_to_pytorch(monkeypatch) -> None:
    def unavailable() -> NativeInt4Matmul:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")

    int4_kernel._choose_on_cpu.cache_clear()
    monkeypatch.setattr(int4_kernel, "native_int4_matmul", lambda _: unavailable())
    assert int4_kernel.choose_int4_kernel(64, 32, torch.device("cpu")) == "torch"
    int4_kernel._choose_on_cpu.cache_clear()


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown int4 kernel"):
        Int4Linear(64, 32, "cpu", kernel="fast")


def test_the_c_decoder_layers_keep_c_kernels_whatever_the_timing(tmp_path, monkeypatch) -> None:
    """PyTorch's kernel timed faster for every shape: where the C decoder layers run, the
    int4 layers stay on the C kernel, as one shape on PyTorch's would take every layer off
    the C path; with the PyTorch attention (no C layers) the timing decides."""
    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path)
    int4_kernel._choose_on_cpu.cache_clear()
    timings = {"native": 2.0, "torch": 1.0}
    monkeypatch.setattr(
        int4_kernel,
        "_time_kernels",
        lambda _in, _out, allowed: {k: ms for k, ms in timings.items() if k in allowed},
    )

    def load(attention: str):
        kwargs = {"dtype": "bfloat16", "quantization": "int4", "progress": False}
        return load_model(tmp_path, attention_backend=attention, **kwargs).model

    c_path = load("cpu_paged")
    assert set(c_path.kernel_plan.int4_kernels.values()) == {"native"}
    assert all(layer.native is not None for layer in c_path.layers)
    reference = load("torch_ref")
    assert set(reference.kernel_plan.int4_kernels.values()) == {"torch"}
    int4_kernel._choose_on_cpu.cache_clear()
