"""The mixture-of-experts families (Qwen3-MoE, OLMoE, Mixtral; model/network/moe.py) on tiny random
checkpoints written by `transformers`, 8 experts of which each token picks 2: read from
safetensors and from a GGUF of the same weights written by the `gguf` package (stacked
expert tensors, float and K-quant), their logits equal `transformers`' in float32, and
greedy output through the engine is the same alone, crowded, chunked and after
preemption."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from model.config import ModelConfig
from model.errors import UnsupportedModelError
from model.greedy import greedy_tokens
from model.loader import load_model
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from model.plan import int4_kernel, layer_formats, weight_format
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams
from tests import test_families
from tests.engine_driver import run_engine
from tests.test_families import hf_logits, prompts
from tests.test_file_blocks import file_like_blocks
from tests.tiny_families import make_tiny, write_gguf

BLOCK = 4
FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
# Mixtral's GGUF is a `llama` one, its Q/K rows interleaved: the K-quant test's reference
# copies the file's matrices as they are, so it takes the two others.
K_QUANT_FAMILIES = ("qwen3_moe", "olmoe")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path, Path]:
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    hf = make_tiny(family, directory)
    gguf = write_gguf(hf, family, directory, directory / "tiny.gguf")
    return family, hf, directory, gguf


def model_logits(model: torch.nn.Module, ids: list[int], block: int = BLOCK) -> torch.Tensor:
    cache = PagedKVCache.allocate(model.config, 64, block, model.dtype)
    table = list(range(-(-len(ids) // block)))
    return model(Batch.build([ids], [0], [table], block, "cpu", all_logits=True), cache)


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_paged"])
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_match_transformers(checkpoint, source, backend) -> None:
    family, hf, directory, gguf = checkpoint
    loaded = load_model(
        directory if source == "safetensors" else gguf,
        dtype=torch.float32,
        progress=False,
        attention_backend=backend,
    )
    c = loaded.config
    assert (c.n_experts, c.n_experts_used) == (8, 2)
    assert c.dense_layers == ((1,) if family == "qwen3_moe" else ())
    assert c.architecture == ("llama" if family == "mixtral" and source == "gguf" else family)
    assert c.num_parameters() == sum(p.numel() for p in hf.parameters())  # experts counted
    for ids in prompts():
        got = model_logits(loaded.model, ids)
        assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-4, (family, len(ids))


def test_logits_on_the_triton_backend_match_transformers(checkpoint) -> None:
    """The CUDA backend's attention kernels with the experts around them (under Triton's
    interpreter where no GPU is lent): the same logits as transformers'."""
    pytest.importorskip("triton")
    family, hf, directory, _ = checkpoint
    if family != "qwen3_moe":
        pytest.skip("the backend is attention's: one family's experts around it suffice")
    loaded = load_model(
        directory, dtype=torch.float32, progress=False, attention_backend="triton_paged"
    )
    assert loaded.model.attention.name == "triton_paged"
    ids = prompts()[-1]
    got = model_logits(loaded.model, ids, block=16)  # the kernels' smallest block
    assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-4, family


def test_the_router_matters(checkpoint) -> None:
    """Sending each token to other experts changes the logits: the test above checks
    which experts were chosen, not only what they compute."""
    family, hf, directory, _ = checkpoint
    loaded = load_model(directory, dtype=torch.float32, progress=False)
    ids = prompts()[-1]
    for layer in loaded.model.layers:
        if layer.moe is not None:
            layer.moe.router.weight.data = layer.moe.router.weight.data.flip(0)
    assert (model_logits(loaded.model, ids) - hf_logits(hf, ids)).abs().max().item() > 1e-2


def _dequantised_reference(hf: torch.nn.Module, gguf: Path) -> torch.nn.Module:
    """`hf` with its experts and projections replaced by the `gguf` package's dequantisation
    of the file's tensors: what a quantised file holds, computed without llamaserve."""
    reader = GGUFReader(gguf)
    stacks = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        stacks[t.name] = torch.from_numpy(np.array(w))
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for ours, theirs in _PROJECTIONS.items():
                if f"blk.{i}.{ours}.weight" in stacks:  # a dense MLP's only in a dense layer
                    layer.get_submodule(theirs).weight.copy_(stacks[f"blk.{i}.{ours}.weight"])
            if f"blk.{i}.ffn_gate_exps.weight" not in stacks:
                continue
            gate_up = [stacks[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up")]
            layer.mlp.experts.gate_up_proj.copy_(torch.cat(gate_up, dim=1))
            layer.mlp.experts.down_proj.copy_(stacks[f"blk.{i}.ffn_down_exps.weight"])
    return hf


_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@pytest.mark.parametrize("family", K_QUANT_FAMILIES)
def test_k_quant_experts(family, tmp_path, monkeypatch) -> None:
    """Experts stored as a Q4_K_M file stores them, Q4_K (gate: blocks with a trained
    layer's scales) and Q6_K (down), with Q4_0 (up) and Q8_0 (attention): read into float32
    they give the dequantised reference's logits within 1e-4; loaded into the quantised
    layers' own formats straight from the file's blocks (int4 holds Q4_K and Q4_0, grouped
    int8 Q8_0, exactly), within their rounding of the activations."""
    hf = make_tiny(family, tmp_path, hidden_size=256, **_WIDE_EXPERTS[family])
    c = hf.config
    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    types, blocks = {}, {}
    for i in range(c.num_hidden_layers):
        types[f"blk.{i}.ffn_down_exps.weight"] = T.Q6_K
        types[f"blk.{i}.ffn_up_exps.weight"] = T.Q4_0
        types |= {f"blk.{i}.{name}.weight": T.Q8_0 for name in _PROJECTIONS}  # where present
        raw = file_like_blocks(T.Q4_K, c.num_experts * ffn, c.hidden_size)
        blocks[f"blk.{i}.ffn_gate_exps.weight"] = (raw.reshape(c.num_experts, ffn, -1), T.Q4_K)
    gguf = write_gguf(hf, family, tmp_path, tmp_path / "k.gguf", types=types, blocks=blocks)
    reference = _dequantised_reference(hf, gguf)
    ids = prompts()[-1]
    want = hf_logits(reference, ids)
    loaded = load_model(gguf, dtype=torch.float32, progress=False)
    assert (model_logits(loaded.model, ids) - want).abs().max().item() < 1e-4
    # A machine where the quantised formats time fastest, int6 beats grouped int8 and our
    # int4 kernel PyTorch's: those choices are timing's own (tests/test_int6_model.py).
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    loaded = load_model(gguf, dtype="auto", quantization="auto", progress=False)
    layer = loaded.model.layers[0]
    kinds = {type(m).__name__ for m in (layer.moe.experts[0].gate_up_proj, layer.qkv_proj)}
    assert kinds == {"Int4Linear", "Int8GroupLinear"}
    assert type(layer.moe.experts[0].down_proj).__name__ == "Int6Linear"
    # A token whose two best experts are nearly tied may pick the other one after any
    # rounding, so the bound is on the typical token: a wrong expert's rows would move all.
    error = (model_logits(loaded.model, ids).float() - want).abs().mean(dim=1)
    assert error.median().item() < 0.05


# Q6_K needs rows of 256: the experts' down projection reads `moe_intermediate_size` columns.
_WIDE_EXPERTS = {"qwen3_moe": {"moe_intermediate_size": 256}, "olmoe": {"intermediate_size": 256}}


def test_greedy_output_is_batch_invariant(checkpoint) -> None:
    """The dense families' engine scenarios (tests/test_families.py) on the GGUF: the
    experts a token picks do not depend on which other tokens share its step."""
    test_families.test_greedy_output_is_batch_invariant(checkpoint)


def test_other_mixtures_of_experts_are_refused_naming_those_supported() -> None:
    for model_type in ("qwen2_moe", "deepseek_v3", "phimoe"):
        with pytest.raises(
            UnsupportedModelError, match="'qwen3_moe', 'olmoe', 'mixtral' and 'gpt_oss'"
        ):
            ModelConfig.from_hf_dict({"model_type": model_type})


@pytest.mark.parametrize("guesser", ["ngram", "draft"])
def test_speculative_decoding_keeps_greedy_output(checkpoint, guesser) -> None:
    """n-gram lookup, or a draft model of the same tokenizer (the MoE itself, so every
    guess is its own choice), proposes several tokens a step, verified in one step: the
    experts each of them picks, and so the greedy output, are those of plain decoding."""
    from tests.test_speculation import run_speculating

    family, _, _, gguf = checkpoint
    if guesser == "draft" and family != "qwen3_moe":
        pytest.skip("the draft's path through the experts is the family's own: one suffices")
    loaded = load_model(gguf, dtype=torch.float32, progress=False)
    texts = [ids * 3 for ids in prompts(4, seed=5)[1:]]  # repeats give n-grams to guess from
    params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [list(greedy_tokens(loaded.model, ids, 24, loaded.tokenizer.stop_ids)) for ids in texts]
    requests = {f"r{i}": (ids, params) for i, ids in enumerate(texts)}
    draft = loaded.model if guesser == "draft" else None
    results, drafted, accepted, _ = run_speculating(loaded, requests, draft=draft)
    assert drafted > 0
    if draft is not None:
        assert accepted > 0.95 * drafted
    for i in range(len(texts)):
        assert [t for out in results[(f"r{i}", 0)] for t in out.new_token_ids] == alone[i]


def test_experts_in_a_family_without_them_are_refused_naming_those_supported() -> None:
    md = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 64,
        "qwen2.attention.head_count": 4,
        "qwen2.block_count": 2,
        "qwen2.feed_forward_length": 128,
        "qwen2.vocab_size": 512,
        "qwen2.expert_count": 8,
        "qwen2.expert_used_count": 2,
    }
    with pytest.raises(
        UnsupportedModelError, match="'qwen3_moe', 'olmoe', 'mixtral' and 'gpt_oss'"
    ):
        ModelConfig.from_gguf_metadata(md, set())


def test_the_c_layer_runs_attention_and_the_experts(checkpoint) -> None:
    """bf16 with grouped int8 layers on the C attention: Qwen3-MoE's and Mixtral's layers run
    attention in the C decoder layer (prefill, and the whole-layer call of a step of
    decodes) and their experts in one C call, and give the PyTorch layer's logits and
    greedy tokens exactly, with the experts in C or in PyTorch; OLMoE's whole-projection
    norms keep its layers in PyTorch."""
    family, _, _, gguf = checkpoint
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="int8g", progress=False, attention_backend="cpu_paged"
    )
    layers = loaded.model.layers
    natives = [layer.native for layer in layers]
    assert all(n is not None for n in natives) == (family != "olmoe")
    sparse = [layer.moe for layer in layers if layer.moe is not None]
    assert all(moe.native is not None for moe in sparse) == (family != "olmoe")
    stop = loaded.tokenizer.stop_ids
    ids = prompts()[-1]

    def run() -> tuple[torch.Tensor, list[int]]:
        return model_logits(loaded.model, ids), list(greedy_tokens(loaded.model, ids, 12, stop))

    with_c = run()
    for moe in sparse:
        moe.native = None
    experts_in_pytorch = run()
    for layer in layers:
        layer.native = None
    without = run()
    for other in (experts_in_pytorch, without):
        assert torch.equal(with_c[0], other[0]) and with_c[1] == other[1]


def test_a_cached_prefix_gives_the_output_computed_without_it(checkpoint) -> None:
    """A second request sharing a long prefix reuses its KV blocks (the experts of the
    cached tokens are not run again) and still gets its greedy output computed alone."""
    _, _, _, gguf = checkpoint
    loaded = load_model(gguf, dtype=torch.float32, progress=False)
    shared = prompts(6, seed=6)[-1][:40]
    texts = [shared + [7, 8, 9], shared + [10, 11]]
    stop = loaded.tokenizer.stop_ids
    alone = [list(greedy_tokens(loaded.model, ids, 12, stop)) for ids in texts]
    engine = create_engine(loaded.model, loaded.tokenizer, EngineConfig())
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first, _ = run_engine(engine, {"a": (texts[0], params)})
    second, _ = run_engine(engine, {"b": (texts[1], params)})
    assert second[("b", 0)].outputs[-1].num_cached_tokens > 0
    assert [first[("a", 0)].token_ids, second[("b", 0)].token_ids] == alone


def test_every_expert_weighted_is_the_grouped_sum(checkpoint) -> None:
    """The path a CUDA graph captures (every expert over every token, unchosen ones
    weighted 0) gives the grouped path's output."""
    _, _, directory, _ = checkpoint
    moe = next(
        layer.moe
        for layer in load_model(directory, dtype=torch.float32, progress=False).model.layers
        if layer.moe is not None
    )
    x = torch.randn(9, moe.router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        grouped = moe(x)
        dense = moe.every_expert(x, *moe.route(x))
    assert (grouped - dense).abs().max().item() < 1e-5
