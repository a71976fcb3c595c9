"""gpt-oss with its experts in MXFP4, as OpenAI's checkpoints and llama.cpp's GGUFs ship it:
from safetensors (`*_blocks`/`*_scales` pairs) and from a GGUF (type 39 stacks) each
expert lands in an MXFP4 layer holding the file's own blocks (gate and up as the even and
odd rows of HF's stack, never dequantised), and the logits equal transformers' on the same
experts dequantised by transformers' own MXFP4 code; greedy output is the same alone and
crowded; in bf16 the experts run in the C layer's one experts call."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from safetensors import safe_open
from transformers import GptOssForCausalLM, Mxfp4Config

from model.checkpoint.mxfp4 import hf_to_gguf_blocks
from model.greedy import greedy_tokens
from model.loader import load_model
from model.native.mxfp4 import NativeMxfp4Matmul
from model.quant.mxfp4 import Mxfp4Linear
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams
from tests.engine_driver import run_engine
from tests.test_families import hf_logits, prompts
from tests.test_moe import model_logits
from tests.tiny_gpt_oss import make_tiny_gpt_oss, write_gpt_oss_gguf
from tests.tiny_gpt_oss_mxfp4 import write_mxfp4_checkpoint

_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """transformers on the MXFP4 checkpoint (its experts dequantised by transformers), the
    checkpoint's directory, and a GGUF of the same weights with MXFP4 expert stacks."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    float_dir = root / "float"
    floats = make_tiny_gpt_oss(float_dir)
    directory = write_mxfp4_checkpoint(floats, float_dir, root / "mxfp4")
    reference = GptOssForCausalLM.from_pretrained(
        directory, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    types = {f"blk.{i}.{n}.weight": T.MXFP4 for i in range(2) for n in _EXPERTS}
    gguf = write_gpt_oss_gguf(reference, float_dir, root / "mxfp4.gguf", types=types)
    ids = prompts()[-1]  # MXFP4's rounding reached the reference
    assert (hf_logits(reference, ids) - hf_logits(floats, ids)).abs().max().item() > 1e-2
    return reference, directory, gguf


def _held_blocks(source: str, directory: Path, gguf: Path) -> dict[str, torch.Tensor]:
    """Layer 1's expert 3 as the file stores it, in GGUF's blocks: gate rows then up rows."""
    if source == "gguf":
        stacks = {t.name: t.data for t in GGUFReader(gguf).tensors}
        part = {n: torch.from_numpy(np.array(stacks[f"blk.1.{n}.weight"][3])) for n in _EXPERTS}
        return {
            "gate_up_proj": torch.cat([part["ffn_gate_exps"], part["ffn_up_exps"]]),
            "down_proj": part["ffn_down_exps"],
        }
    held = {}
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        for name in ("gate_up_proj", "down_proj"):
            prefix = f"model.layers.1.mlp.experts.{name}"
            pair = (f.get_tensor(f"{prefix}_{p}")[3] for p in ("blocks", "scales"))
            rows = hf_to_gguf_blocks(*pair)
            held[name] = torch.cat([rows[0::2], rows[1::2]]) if name == "gate_up_proj" else rows
    return held


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_mxfp4_experts_load_as_stored_and_give_transformers_logits(mxfp4_gpt_oss, source):
    reference, directory, gguf = mxfp4_gpt_oss
    loaded = load_model(directory if source == "safetensors" else gguf, dtype=torch.float32)
    expert = loaded.model.layers[1].moe.experts[3]
    for name, blocks in _held_blocks(source, directory, gguf).items():
        layer = getattr(expert, name)
        assert isinstance(layer, Mxfp4Linear) and layer.on_c_kernel
        assert torch.equal(layer.weight_mxfp4, blocks), name
    for ids in prompts()[-2:]:  # 40 and 61 tokens, past the window of 8
        error = (model_logits(loaded.model, ids) - hf_logits(reference, ids)).abs().max()
        assert error.item() < 1e-4, (source, len(ids))


def test_greedy_output_alone_and_crowded(mxfp4_gpt_oss) -> None:
    _, directory, _ = mxfp4_gpt_oss
    loaded = load_model(directory, dtype=torch.float32, progress=False)
    texts, stop = prompts(6, seed=3), loaded.tokenizer.stop_ids
    alone = [list(greedy_tokens(loaded.model, ids, 12, stop)) for ids in texts]
    engine = create_engine(loaded.model, loaded.tokenizer, EngineConfig())
    params = SamplingParams(max_tokens=12, temperature=0.0)
    results, _ = run_engine(engine, {f"r{i}": (ids, params) for i, ids in enumerate(texts)})
    for i in range(len(texts)):
        assert results[(f"r{i}", 0)].token_ids == alone[i], i


def test_mxfp4_experts_run_in_the_c_layers_experts_call(mxfp4_gpt_oss) -> None:
    """bf16 on the C attention: the biased, clamped MXFP4 experts run in the experts' one C
    call, giving the PyTorch layers' logits exactly."""
    _, _, gguf = mxfp4_gpt_oss
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="int8g", progress=False, attention_backend="cpu_paged"
    )
    layers, ids = loaded.model.layers, prompts()[-1]
    assert all(layer.moe.native is not None for layer in layers)
    assert isinstance(layers[0].moe.experts[0].down_proj, Mxfp4Linear)
    with_c = model_logits(loaded.model, ids)
    for layer in layers:
        layer.moe.native = None
    assert torch.equal(with_c, model_logits(loaded.model, ids))


def test_w4a8_rounds_the_mxfp4_experts_activations_to_int8(mxfp4_gpt_oss) -> None:
    """In w4a8 the MXFP4 experts take int8 activations, as llama.cpp's do, in the C layer's
    experts call as in the PyTorch layers: the same logits, near the reference's."""
    _, _, gguf = mxfp4_gpt_oss
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="w4a8", progress=False, attention_backend="cpu_paged"
    )
    layers, ids = loaded.model.layers, prompts()[-1]
    assert all(layer.moe.native is not None for layer in layers)
    assert layers[1].moe.experts[3].down_proj.kernel == "native_a8"
    with_c = model_logits(loaded.model, ids)
    for layer in layers:
        layer.moe.native = None
    assert torch.equal(with_c, model_logits(loaded.model, ids))
    # The experts on fp32 activations move the logits by about what rounding them to 8 bits
    # does.
    for layer in layers:
        for expert in layer.moe.experts:
            for proj in (expert.gate_up_proj, expert.down_proj):
                proj._native = NativeMxfp4Matmul()
    fp32_experts = model_logits(loaded.model, ids)
    moved = (with_c.float() - fp32_experts.float()).norm() / fp32_experts.float().norm()
    assert 0 < moved < 0.05
