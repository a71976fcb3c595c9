"""MXFP4 weights (model/checkpoint/mxfp4.py, model/quant/mxfp4.py): GGUF's blocks decode as
the `gguf` package decodes them and HF's `*_blocks`/`*_scales` as transformers' own MXFP4
code does; the C kernel at every instruction level this machine executes, and the Triton
kernel under its interpreter, give the dequantised weight's product within fp32 rounding,
each row the same alone as in any batch; a mixture of experts stored in MXFP4 loads into
MXFP4 layers holding the file's bytes and gives the dequantised reference's logits."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from model.checkpoint.dequant import dequantize
from model.checkpoint.file_blocks import FileBlocks
from model.checkpoint.mxfp4 import dequantize_rows, hf_to_gguf_blocks, quantize_rows
from model.loader import load_model
from model.native.mxfp4 import NativeMxfp4Matmul
from model.quant.mxfp4 import Mxfp4Linear
from tests.native_builds import ISAS, library_at

OUT, IN = 40, 320  # ten blocks a row; 40 columns: no multiple of any tile


def random_blocks(rows: int, width: int, seed: int = 0, scales: tuple[int, int] = (112, 132)):
    """GGUF MXFP4 bytes [rows, width / 32 * 17]: random nibbles, scale bytes in `scales`."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, width // 32, 17), dtype=torch.uint8, generator=g)
    raw[..., 0] = torch.randint(*scales, (rows, width // 32), dtype=torch.uint8, generator=g)
    return raw.reshape(rows, -1)


def test_gguf_blocks_decode_and_encode_as_the_gguf_package() -> None:
    raw = random_blocks(6, 256, scales=(0, 255))  # every scale byte but NaN's, subnormals too
    want = gguf_dequantize(raw.numpy(), T.MXFP4).reshape(6, 256)
    got = dequantize(raw.reshape(-1), T.MXFP4, (6, 256))
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))
    w = torch.randn(8, 128) * torch.logspace(-3, 2, 8).unsqueeze(1)
    assert torch.equal(quantize_rows(w), torch.from_numpy(gguf_quantize(w.numpy(), T.MXFP4)))
    # Values from MXFP4 blocks come back to blocks of the same values (a zero may change
    # its sign nibble).
    values = dequantize_rows(random_blocks(6, 256), 256)
    assert torch.equal(dequantize_rows(quantize_rows(values), 256), values)


def test_hf_blocks_decode_as_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 24, 4), dtype=torch.uint8, generator=g)
    # transformers gives [experts, in, out] (gpt-oss multiplies x @ W); ours is [out, in].
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    got = dequantize_rows(hf_to_gguf_blocks(blocks, scales).reshape(3 * 24, -1), 128)
    assert torch.equal(got.reshape(3, 24, 128), want)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of sums of IN products: a few IN ulps of the sum of magnitudes."""
    return (x.double().abs() @ w.double().abs().T) * (IN * 2.0**-24) + 1e-30


@pytest.mark.parametrize("isa", ISAS)
def test_the_c_kernel_gives_the_dequantised_product_row_by_row(isa: str) -> None:
    kernel = NativeMxfp4Matmul(library_at(isa))
    assert kernel.kind == {"avx2": "avx2", "portable": "portable"}.get(isa, kernel.kind)
    raw = random_blocks(OUT, IN)
    w = dequantize_rows(raw, IN)
    g = torch.Generator().manual_seed(2)
    # Values over many octaves, so that fp32 sums round and their order shows.
    x = torch.randn(33, IN, generator=g) * torch.exp2(torch.randint(-12, 12, (33, IN), generator=g))
    got = kernel(x, raw, OUT)
    assert ((got.double() - x.double() @ w.double().T).abs() <= bound(x, w)).all()
    alone = [kernel(x[row : row + 1].clone(), raw, OUT)[0] for row in range(33)]
    # Blocks of 1 to 4 rows share a weight block's decoding; from 21 rows the columns are
    # shared among threads.
    for rows in (2, 3, 4, 5, 7, 9, 33):
        batch = kernel(x[:rows].clone(), raw, OUT)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)
    # bf16 rows: fp32 sums of exact products (dpbf16 with AVX-512 BF16, else x widened),
    # each output rounded once to bf16; each row the same alone as in any batch.
    xb = x.bfloat16()
    exact = xb.double() @ w.double().T
    got = kernel(xb, raw, OUT)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + bound(xb, w)).all()
    if kernel.bf16_kind != "avx512_bf16":
        assert torch.equal(got, kernel(xb.float(), raw, OUT).bfloat16())
    for rows in (1, 2, 5, 8, 9, 33):
        batch = kernel(xb[:rows].clone(), raw, OUT)
        for row in range(rows):
            assert torch.equal(kernel(xb[row : row + 1].clone(), raw, OUT)[0], batch[row])


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_are_the_same_on_every_tile_of_the_loop(isa: str) -> None:
    """bf16 rows take, by their count, a block decoded in registers (one or two rows) or a
    buffer of four decoded columns shared by three rows at a time, tiles of 32 rows, a
    remainder of columns, an odd count of blocks, and two columns whose scales put their
    weights below bf16's normal range (summed unscaled there): every row equals itself
    alone, bit for bit, and the dequantised product within fp32 rounding."""
    kernel = NativeMxfp4Matmul(library_at(isa))
    out, width = 15, 160  # 3 groups of 4 columns and 3 more; 5 blocks a row
    raw = random_blocks(out, width, seed=7)
    raw.view(out, -1, 17)[6, :, 0] = 1  # 2^-127: weights below bf16's normal range
    raw.view(out, -1, 17)[13, :, 0] = 0
    w = dequantize_rows(raw, width)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, width, generator=g) * torch.exp2(
        torch.randint(-8, 8, (37, width), generator=g)
    )
    x = x.bfloat16()
    exact = x.double() @ w.double().T
    got = kernel(x, raw, out)
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + bound(x, w) * 2).all()
    alone = torch.cat([kernel(x[r : r + 1].clone(), raw, out) for r in range(37)])
    assert torch.equal(got, alone)
    for rows in (2, 3, 4, 7):
        assert torch.equal(kernel(x[:rows].clone(), raw, out), alone[:rows]), rows


def test_the_triton_kernel_gives_the_dequantised_product() -> None:
    pytest.importorskip("triton")
    from model.quant.mxfp4_triton import mxfp4_matmul

    raw = random_blocks(OUT, IN, seed=3)
    w = dequantize_rows(raw, IN)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(4))  # fewer than a tile
    got = mxfp4_matmul(x, raw, OUT)
    assert ((got.double() - x.double() @ w.double().T).abs() <= bound(x, w)).all()
    assert torch.equal(mxfp4_matmul(x[2:3], raw, OUT), got[2:3])
    # bf16 rows: fp32 sums, each output rounded once to bf16 (to nearest on a GPU; the
    # interpreter truncates, so within one bf16 step).
    xb = x.bfloat16()
    exact = xb.double() @ w.double().T
    got = mxfp4_matmul(xb, raw, OUT)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7 + bound(xb, w)).all()


def test_the_layer_holds_the_files_blocks_and_multiplies_them() -> None:
    raw = random_blocks(OUT, IN, seed=5)
    from_blocks, from_floats = (Mxfp4Linear(IN, OUT, "cpu", k) for k in ("native", "torch"))
    from_blocks.load_rows(0, FileBlocks(raw, T.MXFP4, IN, torch.float32))
    from_floats.load_rows(0, dequantize_rows(raw, IN))  # quantised back to the same blocks
    assert torch.equal(from_blocks.weight_mxfp4, raw)
    assert torch.equal(from_floats.dequantized(), from_blocks.dequantized())
    x = torch.randn(3, 2, IN)
    got, want = from_blocks(x), from_floats(x)  # the C kernel; PyTorch on the dequantised
    assert got.shape == want.shape == (3, 2, OUT)
    w = from_blocks.dequantized()
    flat = x.reshape(-1, IN)
    assert ((got.reshape(-1, OUT) - want.reshape(-1, OUT)).abs() <= 2 * bound(flat, w)).all()


@pytest.fixture(scope="module")
def mxfp4_moe(tmp_path_factory) -> tuple[torch.nn.Module, object]:
    """A tiny Qwen3-MoE GGUF whose stacked experts the gguf package wrote as MXFP4, and
    transformers on the gguf package's dequantisation of the same file."""
    from tests.test_moe import _dequantised_reference
    from tests.tiny_families import make_tiny, write_gguf

    directory = tmp_path_factory.mktemp("mxfp4")
    hf = make_tiny("qwen3_moe", directory)
    experts = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    types = {f"blk.{i}.{name}.weight": T.MXFP4 for i in (0, 2) for name in experts}
    gguf = write_gguf(hf, "qwen3_moe", directory, directory / "mxfp4.gguf", types=types)
    return _dequantised_reference(hf, gguf), gguf


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_mxfp4_experts_load_as_stored_and_give_the_dequantised_logits(
    mxfp4_moe, cpu_kernels
) -> None:
    """Each expert lands in an MXFP4 layer holding the file's own bytes, and the float32
    model's logits equal the reference's, on the C kernel and on PyTorch's reference."""
    from gguf import GGUFReader

    from tests.test_families import hf_logits, prompts
    from tests.test_moe import model_logits

    reference, gguf = mxfp4_moe
    loaded = load_model(gguf, dtype=torch.float32, progress=False, cpu_kernels=cpu_kernels)
    expert = loaded.model.layers[2].moe.experts[5]
    assert isinstance(expert.down_proj, Mxfp4Linear)
    assert expert.down_proj.on_c_kernel == (cpu_kernels == "auto")
    assert isinstance(expert.gate_up_proj, Mxfp4Linear)
    stack = next(t for t in GGUFReader(gguf).tensors if t.name == "blk.2.ffn_down_exps.weight")
    assert torch.equal(expert.down_proj.weight_mxfp4, torch.from_numpy(np.array(stack.data[5])))
    for ids in prompts()[-2:]:
        got = model_logits(loaded.model, ids)
        assert (got - hf_logits(reference, ids)).abs().max().item() < 1e-4


def test_mxfp4_experts_run_in_the_c_layers_expert_call(mxfp4_moe) -> None:
    """In bf16 on the C attention the MXFP4 experts run in the experts' one C call (the
    weights as the file holds them), near the reference within bf16's rounding."""
    from tests.test_families import hf_logits, prompts
    from tests.test_moe import model_logits

    reference, gguf = mxfp4_moe
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="int8g", progress=False, attention_backend="cpu_paged"
    )
    assert all(loaded.model.layers[i].moe.native is not None for i in (0, 2))
    ids = prompts()[-1]
    error = (model_logits(loaded.model, ids).float() - hf_logits(reference, ids)).abs()
    assert error.mean(dim=1).median().item() < 0.05


def test_an_hf_pair_of_blocks_and_scales_reads_as_mxfp4_rows(tmp_path) -> None:
    """A safetensors file with gpt-oss's stacked `*_blocks`/`*_scales` pair (and a bf16
    tensor beside it) reads as one MXFP4 FileBlocks per pair, never floats, whose rows
    decode as transformers' MXFP4 code decodes the pair."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from model.checkpoint.hf_mxfp4 import join_mxfp4_pairs
    from model.checkpoint.safetensors import iter_safetensors

    g = torch.Generator().manual_seed(6)
    prefix = "model.layers.0.mlp.experts.down_proj"
    blocks = torch.randint(0, 256, (4, 64, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 130, (4, 64, 2), dtype=torch.uint8, generator=g)
    norm = torch.randn(64).bfloat16()
    tensors = {f"{prefix}_blocks": blocks, f"{prefix}_scales": scales, "model.norm.weight": norm}
    save_file(tensors, tmp_path / "model.safetensors")
    read = dict(
        join_mxfp4_pairs(
            iter_safetensors([tmp_path / "model.safetensors"], torch.float32), torch.float32
        )
    )
    assert read.keys() == {prefix, "model.norm.weight"}
    joined = read[prefix]
    assert isinstance(joined, FileBlocks) and joined.shape == (4 * 64, 64)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    expert = 2
    assert torch.equal(joined.rows(expert * 64, (expert + 1) * 64).dequantize(), want[expert])
    assert joined.stack == 4 and torch.equal(joined.matrix(expert).dequantize(), want[expert])
    assert torch.equal(read["model.norm.weight"], norm.float())


def test_an_hf_config_quantised_in_mxfp4_names_every_expert_layer(mxfp4_moe, tmp_path) -> None:
    import json

    from model.checkpoint.hf_mxfp4 import hf_mxfp4_linears
    from model.config import ModelConfig

    _, gguf = mxfp4_moe
    config = json.loads((gguf.parent / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig.from_hf_dir(tmp_path)
    assert hf_mxfp4_linears(tmp_path, model_config) == frozenset()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    keys = hf_mxfp4_linears(tmp_path, model_config)
    assert len(keys) == 2 * 8 * 2  # two sparse layers (1 is dense), 8 experts, 2 layers each
    assert "layers.2.moe.experts.7.down_proj" in keys
    assert not any(k.startswith("layers.1.") for k in keys)
