"""model/checkpoint/meta_weights.py and the loader's Meta-directory branch: a tiny Llama
3-style network
(GQA, the 128,256-token vocabulary, Llama 3.1 rope scaling, Meta's FFN sizing) saved in Meta's
layout (bf16, one and two model-parallel files) and in HF's gives the same fp32 logits in
llamaserve as Meta's own reference Transformer and as `transformers`."""

import json

import pytest
import torch

from model.checkpoint.safetensors import iter_safetensors, safetensors_files
from model.config import ModelConfig
from model.errors import ModelFileError, UnsupportedModelError
from model.loader import load_model
from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.text.llama3_chat import Llama3ChatFormat
from tests.meta_reference import (
    LLAMA3_VOCAB,
    TINY_PARAMS,
    make_meta_model,
    meta_logits,
    meta_tokenizer,
    save_hf_checkpoint,
    save_meta_checkpoint,
)

BLOCK = 16
MAX_POSITION = 512
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    meta = make_meta_model(TINY_PARAMS)
    save_meta_checkpoint(meta, TINY_PARAMS, root / "meta")
    save_meta_checkpoint(meta, TINY_PARAMS, root / "meta-mp2", ranks=2)
    hf = save_hf_checkpoint(meta, TINY_PARAMS, root / "hf")
    return meta, hf, root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    texts = ["Hello", "The capital of France is Paris. 東京は日本の首都です 🤖 1234567"]
    ids = [meta_tokenizer().encode(t, bos=True, eos=False) for t in texts]
    # Long enough for the scaled (low) RoPE frequencies to turn by a visible angle.
    g = torch.Generator().manual_seed(1)
    return [*ids, torch.randint(0, LLAMA3_VOCAB, (300,), generator=g).tolist()]


def ours_logits(model: Llama, ids: list[int], device: str) -> torch.Tensor:
    num_blocks = -(-len(ids) // BLOCK)
    cache = PagedKVCache.allocate(model.config, num_blocks, BLOCK, device=device)
    batch = Batch.build([ids], [0], [list(range(num_blocks))], BLOCK, device, all_logits=True)
    return model(batch, cache).cpu()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def references(tiny, prompts):
    meta, hf, _ = tiny
    return [(meta_logits(meta, ids), hf_logits(hf, ids)) for ids in prompts]


def test_reference_conversion_agrees_with_meta(references):
    # The HF checkpoint is the test's own conversion; Meta's model vouches for it.
    for meta, hf in references:
        assert max_delta(meta, hf) < TOLERANCE


@pytest.mark.parametrize("layout", ["meta", "meta-mp2"])
def test_meta_layout_matches_meta_and_transformers(tiny, prompts, references, layout, device):
    loaded = load_model(tiny[2] / layout, device, max_position=MAX_POSITION, progress=False)
    for ids, (meta, hf) in zip(prompts, references, strict=True):
        got = ours_logits(loaded.model, ids, device)
        assert max_delta(got, meta) < TOLERANCE, layout
        assert max_delta(got, hf) < TOLERANCE, layout


def test_hf_layout_gives_the_same_logits(tiny, prompts, references, device):
    path = tiny[2] / "hf"
    model = Llama.empty(ModelConfig.from_hf_dir(path), MAX_POSITION, device)
    model.load_weights(
        (n, t.to(device)) for n, t in iter_safetensors(safetensors_files(path), torch.float32)
    )
    meta_layout = load_model(tiny[2] / "meta", device, max_position=MAX_POSITION, progress=False)
    for ids, (_, hf) in zip(prompts, references, strict=True):
        got = ours_logits(model.eval(), ids, device)
        assert max_delta(got, hf) < TOLERANCE
        assert max_delta(got, ours_logits(meta_layout.model, ids, device)) < 1e-5


def test_rope_scaling_is_visible_at_these_positions(prompts, references):
    # Without Llama 3.1 scaling the long prompt's logits move far beyond the tolerance, so the
    # comparisons above do check it.
    unscaled = make_meta_model({**TINY_PARAMS, "use_scaled_rope": False})
    assert max_delta(meta_logits(unscaled, prompts[-1]), references[-1][0]) > 100 * TOLERANCE


def test_loaded_config_tokenizer_and_chat_format(tiny):
    loaded = load_model(tiny[2] / "meta", max_position=MAX_POSITION, progress=False)
    config = loaded.config
    meta_ffn = tiny[0].layers[0].feed_forward.w1.weight.shape[0]
    assert (config.ffn_dim, config.n_kv_heads, config.head_dim) == (meta_ffn, 2, 16)
    assert config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
    assert config.max_position == 131072 and not config.tie_embeddings
    assert loaded.tokenizer.vocab_size == LLAMA3_VOCAB and 128009 in loaded.tokenizer.stop_ids
    assert isinstance(loaded.chat_template, Llama3ChatFormat)
    assert loaded.name == "meta"


def test_checkpoint_without_output_weight_ties_embeddings(tmp_path, prompts, device):
    meta = make_meta_model(TINY_PARAMS, seed=5)
    meta.output.weight = meta.tok_embeddings.weight
    save_meta_checkpoint(meta, TINY_PARAMS, tmp_path, drop=("output.weight",))
    loaded = load_model(tmp_path, device, max_position=MAX_POSITION, progress=False)
    assert loaded.config.tie_embeddings
    ids = prompts[1]
    assert max_delta(ours_logits(loaded.model, ids, device), meta_logits(meta, ids)) < TOLERANCE


def write_meta_dir(path, params=None, weights=None, tokenizer_from=None):
    path.mkdir()
    (path / "params.json").write_text(json.dumps(params or TINY_PARAMS))
    if weights is not None:
        torch.save(weights, path / "consolidated.00.pth")
    if tokenizer_from is not None:
        (path / "tokenizer.model").write_bytes((tokenizer_from / "tokenizer.model").read_bytes())
    return path


def test_refusals_name_the_file_and_the_problem(tmp_path, tiny):
    good = tiny[2] / "meta"
    with pytest.raises(ModelFileError, match="neither config.json .* nor params.json"):
        load_model(tmp_path, progress=False)
    with pytest.raises(ModelFileError, match="no consolidated"):
        load_model(write_meta_dir(tmp_path / "no-weights"), progress=False)
    broken = write_meta_dir(tmp_path / "broken")
    (broken / "consolidated.00.pth").write_bytes(b"not a zip file")
    with pytest.raises(ModelFileError, match="consolidated.00.pth: not a readable"):
        load_model(broken, progress=False)
    vision = write_meta_dir(tmp_path / "vision", {**TINY_PARAMS, "vision_chunk_size": 560}, {})
    with pytest.raises(UnsupportedModelError, match="vision_chunk_size"):
        load_model(vision, progress=False)
    llama2 = write_meta_dir(tmp_path / "llama2", {**TINY_PARAMS, "vocab_size": -1}, {})
    with pytest.raises(UnsupportedModelError, match="vocab_size -1"):
        load_model(llama2, progress=False)
    weights = torch.load(good / "consolidated.00.pth", weights_only=True)
    no_tok = write_meta_dir(tmp_path / "no-tokenizer", weights=weights)
    with pytest.raises(ModelFileError, match="no tokenizer.model"):
        load_model(no_tok, progress=False)
    (no_tok / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00")
    with pytest.raises(ModelFileError, match="SentencePiece"):
        load_model(no_tok, progress=False)
    extra = write_meta_dir(
        tmp_path / "extra", weights={**weights, "x.weight": torch.ones(1)}, tokenizer_from=good
    )
    with pytest.raises(ModelFileError, match="unexpected tensor 'x.weight'"):
        load_model(extra, max_position=MAX_POSITION, progress=False)
