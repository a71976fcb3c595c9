"""Each family beside Llama (Qwen2's Q/K/V bias, Qwen3's per-head Q/K norms, Mistral's
sliding window) on tiny random checkpoints written by `transformers`: read from the
safetensors directory and from a GGUF of the same weights, its logits equal
`transformers`' in float32 on every CPU backend, and greedy output through the engine is
the same alone, crowded, chunked and after preemption."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from model.checkpoint import gguf_weights
from model.loader import load_model
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from tests.engine_driver import assert_batch_invariant
from tests.tiny_families import make_tiny, write_gguf

BLOCK = 4
# Mistral with a window far shorter than the prompts, so that the window matters.
CHECKPOINTS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "mistral_window": ("mistral", {"sliding_window": 6}),
    "gemma3": ("gemma3", {}),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path, Path]:
    family, overrides = CHECKPOINTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(family, directory, **overrides)
    gguf = write_gguf(hf, family, directory, directory / "tiny.gguf")
    return request.param, hf, directory, gguf


def prompts(n: int = 6, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 512, (length,), generator=g).tolist()
        for length in (1, 5, 16, 29, 40, 61)[:n]
    ]


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_the_gguf_writer_agrees_with_transformers(checkpoint) -> None:
    """transformers reads the GGUF back to the same logits: the file is what llama.cpp's
    converter would write, not something only llamaserve reads."""
    name, hf, directory, gguf = checkpoint
    if name == "mistral_window":
        pytest.skip("transformers' GGUF reader drops the sliding window")
    back = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf.name, dtype=torch.float32)
    ids = prompts()[-1]
    assert (hf_logits(back.eval(), ids) - hf_logits(hf, ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_paged"])
@pytest.mark.parametrize("source", ["safetensors", "gguf", "gguf_in_blocks"])
def test_logits_match_transformers(checkpoint, source, backend, monkeypatch) -> None:
    name, hf, directory, gguf = checkpoint
    if source == "gguf_in_blocks":  # every matrix in blocks of 16 rows or fewer, as large ones load
        monkeypatch.setattr(gguf_weights, "ROW_BLOCK_BYTES", 4096)
    loaded = load_model(
        directory if source == "safetensors" else gguf,
        dtype=torch.float32,
        progress=False,
        attention_backend=backend,
    )
    for ids in prompts():
        cache = PagedKVCache.allocate(loaded.model.config, 64, BLOCK)
        table = list(range(-(-len(ids) // BLOCK)))
        batch = Batch.build([ids], [0], [table], BLOCK, "cpu", all_logits=True)
        got = loaded.model(batch, cache)
        assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-4, (name, len(ids))


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_match_transformers_on_the_test_device(checkpoint, source, device) -> None:
    """The backend `auto` picks on `--device` (Triton's paged kernels on a GPU, where
    matmuls may round differently, so the bound is looser)."""
    if device == "cpu":
        pytest.skip("the CPU backends are the test above; make test-gpu runs this one")
    name, hf, directory, gguf = checkpoint
    loaded = load_model(
        directory if source == "safetensors" else gguf,
        device=device,
        dtype=torch.float32,
        progress=False,
    )
    block = 16
    for ids in prompts():
        cache = PagedKVCache.allocate(loaded.model.config, 64, block, torch.float32, device)
        table = list(range(-(-len(ids) // block)))
        batch = Batch.build([ids], [0], [table], block, device, all_logits=True)
        got = loaded.model(batch, cache).cpu()
        assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-3, (name, len(ids))


def test_windowed_layers_through_the_triton_kernels(checkpoint, device) -> None:
    """The Triton backend's prefill and decode kernels mask each layer's window (on the GPU
    with --device cuda, else on CPU tensors under Triton's interpreter): the longest
    prompts, all but the last token in one prefill, then the last as a decode, against
    transformers' logits."""
    name, hf, directory, _ = checkpoint
    if name not in ("mistral_window", "gemma3"):
        pytest.skip("a family with a sliding window")
    pytest.importorskip("triton")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("where a GPU is visible, Triton's interpreter is off: run with --device cuda")
    loaded = load_model(
        directory,
        dtype=torch.float32,
        device=device,
        progress=False,
        attention_backend="triton_paged",
    )
    block = 16  # the Triton kernels' smallest block
    for ids in prompts()[-2:]:
        want = hf_logits(hf, ids)
        cache = PagedKVCache.allocate(loaded.model.config, 16, block, torch.float32, device)
        table = list(range(-(-len(ids) // block)))
        prefill = Batch.build([ids[:-1]], [0], [table], block, device, all_logits=True)
        got = loaded.model(prefill, cache).cpu()
        assert (got - want[:-1]).abs().max().item() < 1e-4, (name, len(ids), "prefill")
        decode = Batch.build([ids[-1:]], [len(ids) - 1], [table], block, device)
        got = loaded.model(decode, cache).cpu()
        assert (got[-1] - want[-1]).abs().max().item() < 1e-4, (name, len(ids), "decode")


def test_the_window_is_what_makes_mistral_window_differ(checkpoint, tmp_path) -> None:
    """Without its window the same weights give other logits: the test above can fail."""
    name, hf, directory, _ = checkpoint
    if name != "mistral_window":
        pytest.skip("one checkpoint has a window")
    whole = make_tiny("mistral", tmp_path)  # the same seed, so the same weights
    ids = prompts()[-1]
    assert (hf_logits(whole, ids) - hf_logits(hf, ids)).abs().max().item() > 1e-2


def test_greedy_output_is_batch_invariant(checkpoint) -> None:
    name, _, directory, gguf = checkpoint
    loaded = load_model(gguf, dtype=torch.float32, progress=False)
    texts = prompts(6, seed=3) + prompts(6, seed=4)
    # A cache of 160 tokens: room for about a third of the requests' 500 at once.
    assert_batch_invariant(loaded, texts, 16, kv_tokens=160, label=name)
