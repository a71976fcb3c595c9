"""gpt-oss (model/families/gpt_oss.py) on a tiny random checkpoint written by `transformers`:
read from safetensors and from a GGUF of the same weights under llama.cpp's names, its
logits equal `transformers`' in float32 on each CPU backend; attention sinks, the
experts' clamps and the router's bias each matter; YaRN's tables are transformers'; and
greedy output through the engine is the same alone, crowded, chunked across the window
and after preemption."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from model.config import ModelConfig
from model.errors import UnsupportedModelError
from model.greedy import greedy_tokens
from model.loader import load_model
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from model.network.rope import attention_factor, inverse_frequencies
from model.parallel.plan import TensorParallel
from tests import test_families
from tests.test_families import hf_logits, prompts
from tests.test_moe import model_logits
from tests.tiny_gpt_oss import SHAPE, make_tiny_gpt_oss, write_gpt_oss_gguf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, torch.nn.Module, Path, Path]:
    directory = tmp_path_factory.mktemp("gpt_oss")
    hf = make_tiny_gpt_oss(directory)
    return "gpt_oss", hf, directory, write_gpt_oss_gguf(hf, directory, directory / "tiny.gguf")


def _max_error(loaded, hf: torch.nn.Module, ids: list[int]) -> float:
    return (model_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item()


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_paged"])
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_match_transformers(checkpoint, source, backend) -> None:
    _, hf, directory, gguf = checkpoint
    path = directory if source == "safetensors" else gguf
    loaded = load_model(path, dtype=torch.float32, progress=False, attention_backend=backend)
    c = loaded.config
    assert c.architecture == "gpt_oss" and c.rope_scaling.rope_type == "yarn"
    assert (c.sliding_window, c.full_attention_layers, c.n_experts_used) == (8, (1,), 2)
    assert c.num_parameters() == sum(p.numel() for p in hf.parameters())
    for ids in prompts():  # up to 61 tokens: far past the window of 8
        assert _max_error(loaded, hf, ids) < 1e-4, (source, backend, len(ids))


def test_sinks_clamps_and_router_bias_matter(checkpoint) -> None:
    """Each of gpt-oss's own parts, taken away, moves the logits: the test above checks
    them, not only Llama's layer around them."""
    _, hf, directory, _ = checkpoint
    loaded = load_model(directory, dtype=torch.float32, progress=False)
    layers, ids = loaded.model.layers, prompts()[-1]
    for take_away in ("sinks", "limit", "router bias"):
        for layer in layers:
            if take_away == "sinks":
                layer.sinks.data.zero_()
            for expert in layer.moe.experts:
                expert.limit = None if take_away == "limit" else expert.limit
            if take_away == "router bias":
                layer.moe.router.bias.data.zero_()
        assert _max_error(loaded, hf, ids) > 1e-2, take_away
        loaded = load_model(directory, dtype=torch.float32, progress=False)
        layers = loaded.model.layers


def test_q8_0_experts_give_the_dequantised_reference(checkpoint, tmp_path) -> None:
    """Experts and attention stored in Q8_0 (V in F16): the `gguf` package's dequantisation
    of the file's tensors, put back into transformers' model, gives our logits within 1e-4."""
    _, hf, directory, _ = checkpoint
    types = {}
    for i in range(SHAPE["num_hidden_layers"]):
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_output"):
            types[f"blk.{i}.{name}.weight"] = T.Q8_0
        types[f"blk.{i}.attn_v.weight"] = T.F16
    gguf = write_gpt_oss_gguf(hf, directory, tmp_path / "q8.gguf", types=types)
    stacks = {
        t.name: torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type)).reshape(tuple(reversed(t.shape.tolist())))
        )
        for t in GGUFReader(gguf).tensors
    }
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            layer.self_attn.q_proj.weight.copy_(stacks[f"blk.{i}.attn_q.weight"])
            layer.self_attn.o_proj.weight.copy_(stacks[f"blk.{i}.attn_output.weight"])
            layer.self_attn.v_proj.weight.copy_(stacks[f"blk.{i}.attn_v.weight"])
            gate, up = (stacks[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up"))
            experts = layer.mlp.experts
            experts.gate_up_proj[..., ::2] = gate.transpose(1, 2)
            experts.gate_up_proj[..., 1::2] = up.transpose(1, 2)
            experts.down_proj.copy_(stacks[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2))
    loaded = load_model(gguf, dtype=torch.float32, progress=False)
    ids = prompts()[-1]
    assert _max_error(loaded, reference, ids) < 1e-4
    assert _max_error(loaded, hf, ids) > 1e-4  # the file's rounding did reach the reference


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_transformers(truncate) -> None:
    """gpt-oss's YaRN (factor 32 over 4096 positions, beta 32 and 1, bounds unrounded as its
    config says), at gpt-oss-20b's head_dim and base, and rounded as transformers' default."""
    hf = GptOssConfig(head_dim=64)
    hf.rope_parameters["truncate"] = truncate
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = ModelConfig.from_hf_dict(hf.to_dict())
    assert ours.rope_scaling.truncate is truncate
    got = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.equal(got, want)
    assert attention_factor(ours.rope_scaling) == pytest.approx(want_factor, rel=1e-12)


def test_greedy_output_is_batch_invariant(checkpoint) -> None:
    """The dense families' engine scenarios on the GGUF: alone, crowded, chunked in chunks
    of 7 (prompts of up to 61 tokens crossing the window of 8) and after preemption."""
    test_families.test_greedy_output_is_batch_invariant(checkpoint)


def test_the_c_layer_runs_attention_and_the_experts(checkpoint) -> None:
    """bf16 with grouped int8 layers on the C attention: the C decoder layer runs attention
    (prefill, and the whole-layer call of a step of decodes) with the sinks and the O bias,
    and the biased, clamped experts run in one C call; the logits (of a prefill and of
    decode steps) and greedy tokens are exactly the PyTorch layer's, with the experts in C
    or in PyTorch."""
    _, _, _, gguf = checkpoint
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="int8g", progress=False, attention_backend="cpu_paged"
    )
    layers = loaded.model.layers
    assert all(layer.native is not None and layer.moe.native is not None for layer in layers)
    ids, stop = prompts()[-1], loaded.tokenizer.stop_ids

    def run() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        return (
            model_logits(loaded.model, ids),
            _decoded_logits(loaded.model, ids, 4),
            list(greedy_tokens(loaded.model, ids, 12, stop)),
        )

    with_c = run()
    for layer in layers:
        layer.moe.native = None
    experts_in_pytorch = run()
    for layer in layers:
        layer.native = None
    without = run()
    for other in (experts_in_pytorch, without):
        assert torch.equal(with_c[0], other[0]) and torch.equal(with_c[1], other[1])
        assert with_c[2] == other[2]


def _decoded_logits(
    model: torch.nn.Module, ids: list[int], decodes: int, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The logits of the last `decodes` tokens, each a step of its own after a prefill of
    the rest: the steps the C layer runs whole, sinks included."""
    cache = PagedKVCache.allocate(model.config, 64, 4, kv_dtype or model.dtype)
    table, first = list(range(-(-len(ids) // 4))), len(ids) - decodes
    model(Batch.build([ids[:first]], [0], [table], 4), cache)
    steps = [model(Batch.build([[ids[i]]], [i], [table], 4), cache) for i in range(first, len(ids))]
    return torch.cat(steps)


def test_an_int8_kv_cache_keeps_the_sinks(checkpoint) -> None:
    """Over an int8 KV cache the C attention has no sinks: gpt-oss's decode steps there
    take the reference, and their logits are the reference backend's on the same cache
    (dropping the sinks moves them by more than 1e-2: the test above)."""
    _, _, _, gguf = checkpoint
    ids = prompts()[-1]
    logits = [
        _decoded_logits(
            load_model(gguf, dtype=torch.float32, progress=False, attention_backend=backend).model,
            ids,
            4,
            torch.int8,
        )
        for backend in ("cpu_paged", "torch_ref")
    ]
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


def test_logits_on_the_triton_backend_match_transformers(checkpoint) -> None:
    """Triton's paged kernels with sinks and windows (under Triton's interpreter where no GPU
    is lent): a prompt's first 20 tokens as one prefill, then 4 decoded one by one, give
    transformers' logits."""
    pytest.importorskip("triton")
    _, hf, directory, _ = checkpoint
    loaded = load_model(
        directory, dtype=torch.float32, progress=False, attention_backend="triton_paged"
    )
    model = loaded.model
    assert model.attention.name == "triton_paged"
    ids = prompts()[-1][:24]  # past the window of 8, within two blocks of 16
    cache = PagedKVCache.allocate(model.config, 4, 16, model.dtype)
    table, prefill = [0, 1], 20
    steps = [model(Batch.build([ids[:prefill]], [0], [table], 16, "cpu", all_logits=True), cache)]
    for i in range(prefill, len(ids)):
        steps.append(model(Batch.build([[ids[i]]], [i], [table], 16), cache))
    assert (torch.cat(steps) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_tensor_parallelism_is_refused() -> None:
    config = ModelConfig.from_hf_dict(GptOssConfig(**SHAPE).to_dict())
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        TensorParallel(0, 2).check(config)
