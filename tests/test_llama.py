"""The Llama forward against `transformers` on tiny random checkpoints, and the paged
cache's consistency: one prefill, cached prefix + rest, and token-by-token decode agree,
and sequences batched together agree with each alone."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint.safetensors import iter_safetensors, safetensors_files
from model.config import ModelConfig
from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from tests.tiny_models import make_tiny_llama

BLOCK = 4
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "mha": dict(heads="mha"),
    "gqa": dict(heads="gqa"),
    "mqa": dict(heads="mqa"),
    "tied": dict(heads="gqa", tie=True),
    "llama3_rope": dict(heads="gqa", rope_scaling=LLAMA3_SCALING),
    "linear_rope": dict(heads="mha", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "sharded": dict(heads="gqa", max_shard_size="100KB"),
}


def load_ours(path: Path, device: str) -> Llama:
    config = ModelConfig.from_hf_dir(path)
    model = Llama.empty(config, device=device)
    model.load_weights(
        (n, t.to(device)) for n, t in iter_safetensors(safetensors_files(path), torch.float32)
    )
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, device):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_llama(path, **VARIANTS[request.param])
    return request.param, hf, load_ours(path, device), path


class Blocks:
    """Hands out consecutive blocks to sequences: enough bookkeeping for a forward test."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK)
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def cache_for(model: Llama, device: str, num_blocks: int = 256) -> PagedKVCache:
    return PagedKVCache.allocate(model.config, num_blocks, BLOCK, device=device)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 16, 29, 50][:n]
    return [torch.randint(0, 512, (length,), generator=g).tolist() for length in lengths]


def test_logits_match_transformers(pair, device):
    variant, hf, ours, path = pair
    if variant == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(safetensors_files(path)) > 1
    for ids in prompts(6):
        blocks = Blocks()
        batch = Batch.build([ids], [0], [blocks.take(len(ids))], BLOCK, device, all_logits=True)
        got = ours(batch, cache_for(ours, device)).cpu()
        want = hf_logits(hf, ids)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4, variant


def test_prefix_then_rest_and_decode_agree(pair, device):
    _, _, ours, _ = pair
    ids = prompts(6)[-1]
    cache = cache_for(ours, device)
    table = Blocks().take(len(ids))
    whole = ours(Batch.build([ids], [0], [table], BLOCK, device, all_logits=True), cache).cpu()

    cache = cache_for(ours, device)
    split = 21  # not a block boundary: the rest starts inside a partly filled block
    first = ours(Batch.build([ids[:split]], [0], [table], BLOCK, device, all_logits=True), cache)
    rest = ours(Batch.build([ids[split:]], [split], [table], BLOCK, device, all_logits=True), cache)
    assert (torch.cat([first, rest]).cpu() - whole).abs().max().item() < 1e-4

    cache = cache_for(ours, device)
    steps = [
        ours(Batch.build([[t]], [i], [table], BLOCK, device), cache) for i, t in enumerate(ids)
    ]
    assert (torch.cat(steps).cpu() - whole).abs().max().item() < 1e-4


def test_flat_batch_equals_each_alone(pair, device):
    _, _, ours, _ = pair
    seqs = prompts(6, seed=7)
    blocks = Blocks()
    tables = [blocks.take(len(s) + 8) for s in seqs]
    alone = []
    for s, t in zip(seqs, tables, strict=False):
        alone.append(ours(Batch.build([s], [0], [t], BLOCK, device), cache_for(ours, device)))
    # One step mixing: whole prefills, prefills over a cached prefix, and decodes.
    cache = cache_for(ours, device)
    cached = [0, 2, 5, 15, 28, 0]
    warm = [i for i, c in enumerate(cached) if c]
    ours(
        Batch.build(
            [seqs[i][: cached[i]] for i in warm],
            [0] * len(warm),
            [tables[i] for i in warm],
            BLOCK,
            device,
            null_block=cache.null_block,
        ),
        cache,
    )
    mixed = ours(
        Batch.build(
            [s[c:] for s, c in zip(seqs, cached, strict=False)],
            cached,
            tables,
            BLOCK,
            device,
            null_block=cache.null_block,
        ),
        cache,
    )
    assert (mixed.cpu() - torch.cat(alone).cpu()).abs().max().item() < 1e-4


def test_an_empty_model_is_built_without_importing_dynamo_or_sympy() -> None:
    """`Llama.empty` builds its skeleton on the meta device with the init's random fills
    skipped and makes its tensors real with plain factories (model/network/meta_init.py): on meta
    tensors the fills and `empty_like` run through Python decompositions that import
    torch._dynamo and sympy, 2 s of a server's start. In a fresh interpreter, loading the
    default model leaves both unimported."""
    code = (
        "import sys; from model.loader import load_model; load_model(progress=False); "
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["False", "False"]
