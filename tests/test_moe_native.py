"""A mixture of experts' experts in one C call (model/native/moe_experts.c) against the PyTorch
path (model/network/moe.py) on the same quantised experts, each C weight kind in turn: the
same kernels and rounding points, so the residual plus the experts' output is bit for bit
the same, for one row (a decode) and for batches where experts share rows; and at every
instruction level the machine executes."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from model.native.build import ISA_ENV
from model.network.decoder_layer import _native_weight
from model.network.moe import SparseMoE
from model.quant.factory import quantized_linear
from tests.native_builds import ISAS, MACHINE_ISAS, library_at

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)

DIM, FFN, EXPERTS, TOP_K = 256, 256, 8, 3
# (gate/up format, its int4 kernel, down format): every kind the C layer reads.
FORMATS = [
    ("int4", "native", "int8g"),
    ("w4a8", "native_a8", "int6"),
    ("int4", "native", "w6a8"),  # an AVX2-only CPU's Q6_K down projection in w4a8
    ("int5", None, "w5a8"),
    ("int8g", None, "int4"),
    ("mxfp4", None, "mxfp4"),  # gpt-oss's experts, the file's MXFP4 blocks as they are
]


def quantised_moe(gate_up: str, kernel: str | None, down: str) -> SparseMoE:
    torch.manual_seed(0)
    config = SimpleNamespace(
        n_experts=EXPERTS, n_experts_used=TOP_K, norm_topk_prob=True, dim=DIM, expert_ffn_dim=FFN
    )
    config.expert_bias, config.swiglu_limit, config.swiglu_alpha = False, None, 1.702
    moe = SparseMoE(config)
    moe.router.weight.data = torch.randn(EXPERTS, DIM).to(torch.bfloat16)
    for expert in moe.experts:
        expert.gate_up_proj = quantized_linear(gate_up, DIM, 2 * FFN, "cpu", kernel)
        expert.gate_up_proj.load_rows(0, torch.randn(2 * FFN, DIM) * 0.05)
        expert.down_proj = quantized_linear(down, FFN, DIM, "cpu", "native")
        expert.down_proj.load_rows(0, torch.randn(DIM, FFN) * 0.05)
    return moe


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("formats", FORMATS, ids=["-".join(map(str, f)) for f in FORMATS])
def test_c_experts_equal_the_pytorch_path(formats, isa, monkeypatch) -> None:
    library_at(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    moe = quantised_moe(*formats)
    assert moe.use_native(_native_weight)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 13):
            h = torch.randn(rows, DIM, generator=generator).to(torch.bfloat16)
            x = torch.randn(rows, DIM, generator=generator).to(torch.bfloat16)
            got = moe.residual(h, lambda _, x=x: x)
            assert torch.equal(got, h + moe(x)), (formats, rows)


@pytest.mark.parametrize("isa", MACHINE_ISAS)
def test_mxfp4_experts_split_by_columns_equal_the_pytorch_path(isa, monkeypatch) -> None:
    """gpt-oss's MXFP4 experts (biases, clamped gate) at widths that the C call cuts into
    several column pieces, the last one narrower (moe_experts.c's SPLIT_COLS): the same
    bits as the PyTorch path, on one thread and on two, whatever shares the step."""
    library_at(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    dim, ffn = 320, 608  # pieces: down 2 of 160 columns, gate/up 3 of 204, 204 and 200
    torch.manual_seed(2)
    config = SimpleNamespace(
        n_experts=EXPERTS, n_experts_used=TOP_K, norm_topk_prob=True, dim=dim, expert_ffn_dim=ffn
    )
    config.expert_bias, config.swiglu_limit, config.swiglu_alpha = True, 0.6, 1.702
    moe = SparseMoE(config)
    moe.router.weight.data = torch.randn(EXPERTS, dim).to(torch.bfloat16)
    moe.router.bias.data = torch.randn(EXPERTS).to(torch.bfloat16)
    for expert in moe.experts:
        expert.gate_up_proj = quantized_linear("mxfp4", dim, 2 * ffn, "cpu", None)
        expert.gate_up_proj.load_rows(0, torch.randn(2 * ffn, dim) * 0.05)
        expert.down_proj = quantized_linear("mxfp4", ffn, dim, "cpu", "native")
        expert.down_proj.load_rows(0, torch.randn(dim, ffn) * 0.05)
        expert.gate_up_proj_bias.data = (torch.randn(2 * ffn) * 0.3).to(torch.bfloat16)
        expert.down_proj_bias.data = (torch.randn(dim) * 0.3).to(torch.bfloat16)
    assert moe.use_native(_native_weight)
    generator = torch.Generator().manual_seed(3)
    h = torch.randn(9, dim, generator=generator).to(torch.bfloat16)
    x = torch.randn(9, dim, generator=generator).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            want = h + moe(x)
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (slice(0, 1), slice(0, 3), slice(0, 9), slice(4, 6)):
                    got = moe.residual(h[rows], lambda _, x=x[rows]: x)
                    assert torch.equal(got, want[rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)
