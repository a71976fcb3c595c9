"""The grouped-int8 output projection (model/native/int8_matmul.c, Int8GroupLinear): its
kernel against `F.linear` on the same weights in fp32, at every instruction level; GGUF Q8_0 groups
held exactly; a tied model's embedding read from it; and when the loader takes it."""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

import model.plan.head_format as head_format
from model.checkpoint.default_model import default_model_path
from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.gguf_weights import output_quantized
from model.checkpoint.safetensors import iter_safetensors, safetensors_files
from model.config import ModelConfig
from model.native.build import NativeUnavailable
from model.native.ops import NativeInt8Matmul
from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.plan.head_format import choose_head_int8
from model.plan.weight_format import WeightFormat
from model.quant.base import fp16_scales
from model.quant.int8_group import Int8GroupLinear
from tests.native_builds import ISAS, kernel_build
from tests.tiny_families import make_tiny, write_gguf
from tests.tiny_models import make_tiny_llama

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)

CPU = torch.device("cpu")
INT4 = WeightFormat(torch.bfloat16, "int4")


def q8_0_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """w = d * q with q in -127..127 and |q| = 127 in every group of 32, as Q8_0 stores
    it; d rounded through fp16 like the file's."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features // 32, 32), generator=generator)
    q[..., 0] = 127
    d = (torch.rand(out_features, in_features // 32, 1, generator=generator) * 1e-3).half()
    return (q.float() * d.float()).reshape(out_features, in_features)


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> NativeInt8Matmul:
    return kernel_build(NativeInt8Matmul, request.param)


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 4096), (64, 48)])
def test_matches_fp32_on_the_same_weights(kernel, in_features, out_features) -> None:
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    # fp16 scales, as the kernel reads them (and as GGUF's Q8_0 stores them).
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01).half()
    weight, tiled = kernel.pack(q.clone(), scales)  # reordered in place
    reference = (q.float().view(out_features, -1, 32) * scales.float()[..., None]).view(
        out_features, -1
    )
    # 65: from 64 rows on, each tile is converted once for all the blocks of 8 rows.
    for rows in (1, 8, 9, 20, 65):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, weight, tiled, out_features)
        assert y.dtype == torch.float32
        expected = F.linear(x.float(), reference)
        assert ((y - expected).norm() / expected.norm()).item() < 1e-5, rows
        assert torch.equal(kernel(x[-1:].clone(), weight, tiled, out_features)[0], y[-1])


def test_q8_0_groups_are_held_exactly() -> None:
    weight = q8_0_weight(64, 96)
    layer = Int8GroupLinear(96, 64, "cpu")
    layer.load_rows(32, weight[32:])
    layer.load_rows(0, weight[:32])
    assert torch.equal(layer.embed(torch.arange(64), torch.float32), weight)
    x = torch.randn(5, 96).bfloat16()
    expected = F.linear(x.float(), weight)
    assert ((layer(x) - expected).norm() / expected.norm()).item() < 1e-5


def load_tiny(path: Path, head_int8: bool) -> Llama:
    config = ModelConfig.from_hf_dir(path)
    model = Llama.empty(config, dtype=torch.bfloat16, quantization="int4", head_int8=head_int8)
    model.load_weights(iter_safetensors(safetensors_files(path), torch.float32))
    return model.eval()


def test_a_tied_model_holds_its_vocabulary_once(tmp_path) -> None:
    make_tiny_llama(tmp_path, heads="gqa", tie=True)
    int8, bf16 = load_tiny(tmp_path, True), load_tiny(tmp_path, False)
    assert isinstance(int8.lm_head, Int8GroupLinear) and int8.embed_from_head
    assert int8.embed_tokens.weight.shape[0] == 0
    ids = torch.tensor([0, 7, 511])
    # Requantised from the checkpoint's fp32 values: the lookup is within int8's rounding.
    assert (int8._embed(ids).float() - bf16._embed(ids).float()).abs().max().item() < 2e-3

    def logits(model: Llama) -> torch.Tensor:
        cache = PagedKVCache.allocate(model.config, 4, 16, torch.bfloat16)
        return model(Batch.build([list(range(3, 40))], [0], [[0, 1, 2]], 16), cache)

    ours, reference = logits(int8), logits(bf16)
    assert ours.dtype == torch.float32
    assert ((ours - reference).norm() / reference.norm()).item() < 2e-2


def test_the_default_model_s_output_is_quantized() -> None:
    assert output_quantized(open_gguf(default_model_path()))


Q5_0 = GGMLQuantizationType.Q5_0


def test_only_a_head_the_file_quantises_counts_as_quantized(tmp_path) -> None:
    hf = make_tiny("qwen3", tmp_path)  # an untied output projection
    floats = write_gguf(hf, "qwen3", tmp_path, tmp_path / "f.gguf")
    q5 = write_gguf(hf, "qwen3", tmp_path, tmp_path / "q.gguf", types={"output.weight": Q5_0})
    assert not output_quantized(open_gguf(floats))
    assert output_quantized(open_gguf(q5))


def test_chosen_only_where_the_file_quantises_it_and_faster(monkeypatch) -> None:
    config = ModelConfig(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128, vocab_size=512
    )
    monkeypatch.setattr(head_format, "_head_ms", lambda *_: (1.0, 2.0))
    assert choose_head_int8(config, INT4, True, CPU)
    assert not choose_head_int8(config, INT4, False, CPU)  # a float head stays in floats
    assert not choose_head_int8(config, WeightFormat(torch.bfloat16), True, CPU)
    assert not choose_head_int8(config, WeightFormat(torch.float32, "int4"), True, CPU)
    monkeypatch.setattr(head_format, "_head_ms", lambda *_: (2.0, 1.0))
    assert not choose_head_int8(config, INT4, True, CPU)

    def unavailable(*_) -> None:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(head_format, "_head_ms", unavailable)
    assert not choose_head_int8(config, INT4, True, CPU)


def test_fp16_scales_never_vanish_or_overflow() -> None:
    """Scales outside float16's range keep their sign at its ends rather than becoming 0
    (a group of tiny weights would divide by zero) or infinity."""
    scales = torch.tensor([1e-12, -1e-12, 0.5, -3.0, 1e6, 0.0])
    half = fp16_scales(scales)
    assert half.dtype == torch.float16
    assert half[:5].ne(0).all() and half.isfinite().all()
    assert torch.equal(half[:5].sign(), scales[:5].sign())
    assert half[2].item() == 0.5 and half[3].item() == -3.0 and half[4].item() == 65504.0
    # Weights whose scale lies below float16's normal range: held on its smallest step.
    tiny = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 1e-6
    layer = Int8GroupLinear(64, 16, "cpu")
    layer.load_rows(0, tiny)
    held = layer.embed(torch.arange(16), torch.float32)
    assert held.isfinite().all() and held.abs().amax() > 0
    assert (held - tiny).abs().amax() <= 2.0**-25 * 1.001
