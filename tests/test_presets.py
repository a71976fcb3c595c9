"""model/presets.py and the Meta side of model/config.py: the Llama 3 shapes give the published
parameter counts and KV bytes per token, agree with Meta's own records (`llama-models`' SKU list
and reference code), and `load_random_model` builds a servable model from a shape."""

import base64

import pytest
import torch
from llama_models.sku_list import resolve_model

from model import random_model
from model.config import ModelConfig, meta_ffn_dim
from model.errors import UnsupportedModelError
from model.greedy import greedy_tokens
from model.network.llama import Llama
from model.network.rope import inverse_frequencies
from model.presets import PRESETS, preset_config
from model.text.llama3_chat import Llama3ChatFormat
from scheduler.runner.kv_capacity import kv_bytes_per_block
from tests.meta_reference import meta_model_module, meta_tokenizer, meta_tokenizer_path

# Parameter counts of the published checkpoints (HF safetensors totals; 1B and 3B tie their
# output to the embedding) and the KV cache they need per token in bf16.
PUBLISHED = {
    "llama3-1b": ("Llama3.2-1B", 1_235_814_400, 32 * 1024),
    "llama3-3b": ("Llama3.2-3B", 3_212_749_824, 112 * 1024),
    "llama3-8b": ("Llama3.1-8B", 8_030_261_248, 128 * 1024),
    "llama3-70b": ("Llama3.1-70B", 70_553_706_496, 320 * 1024),
}
# intermediate_size in the published HF configs.
PUBLISHED_FFN = {"llama3-1b": 8192, "llama3-3b": 8192, "llama3-8b": 14336, "llama3-70b": 28672}


def meta_arch_args(sku: str) -> dict:
    return resolve_model(sku).arch_args


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_and_kv_bytes_are_the_published_ones(name):
    _, params, kv_bytes = PUBLISHED[name]
    config = preset_config(name)
    assert abs(config.num_parameters() - params) / params < 0.005
    per_token = kv_bytes_per_block(config.n_layers, config.n_kv_heads, config.head_dim, 1, 2)
    assert per_token == kv_bytes
    assert config.ffn_dim == PUBLISHED_FFN[name]
    # The formula counts what the network really allocates.
    model = Llama.empty(config, max_position=16, device="meta")
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_agree_with_metas_params(name):
    sku = PUBLISHED[name][0]
    config = preset_config(name)
    tensors = set() if config.tie_embeddings else {"output.weight"}
    assert ModelConfig.from_meta_params(meta_arch_args(sku), tensors, source=sku) == config


def test_ffn_width_is_metas():
    module = meta_model_module()
    shapes = [
        (a["dim"], a["multiple_of"], a.get("ffn_dim_multiplier"))
        for a in (meta_arch_args(s) for s, _, _ in PUBLISHED.values())
    ]
    shapes += [
        (16384, 4096, 1.2),
        (5120, 256, 1.3),
        (4096, 256, None),
        (128, 32, 1.3),
        (96, 7, 0.9),
    ]
    for dim, multiple_of, multiplier in shapes:
        with torch.device("meta"):
            ffn = module.FeedForward(dim, 4 * dim, multiple_of, multiplier)
        assert meta_ffn_dim(dim, multiple_of, multiplier) == ffn.w1.weight.shape[0], dim


def test_rope_frequencies_follow_metas_reference():
    module = meta_model_module()
    args = meta_arch_args("Llama3.1-8B")
    config = ModelConfig.from_meta_params(args, {"output.weight"})
    angles = module.precompute_freqs_cis(config.head_dim, 2, args["rope_theta"], True)
    ours = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, angles[1].angle(), rtol=1e-6, atol=0)


def test_meta_llama3_without_scaling_and_llama32_factor():
    config = ModelConfig.from_meta_params(meta_arch_args("Llama-3-8B"), {"output.weight"})
    assert config.rope_scaling.rope_type == "default" and config.max_position == 8192
    # Meta's params.json omits it; the corrected HF configs of 3.2 1B/3B say 32.
    small = ModelConfig.from_meta_params(meta_arch_args("Llama3.2-1B-Instruct"), set())
    assert small.rope_scaling.factor == 32.0 and small.tie_embeddings
    explicit = {**meta_arch_args("Llama3.1-8B"), "rope_scaling_factor": 16.0}
    assert ModelConfig.from_meta_params(explicit, set()).rope_scaling.factor == 16.0


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(UnsupportedModelError, match="llama3-1b, llama3-3b, llama3-70b, llama3-8b"):
        preset_config("llama3-405b")


@pytest.fixture
def tiny_preset(monkeypatch):
    config = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=PRESETS["llama3-8b"].rope_scaling,
        max_position=1024,
    )
    monkeypatch.setitem(PRESETS, "tiny", config)
    return "tiny"


def test_random_model_is_servable_and_seeded(tiny_preset, device):
    loaded = random_model.load_random_model(tiny_preset, device, seed=1)
    assert loaded.name == "tiny-random" and loaded.config == PRESETS["tiny"]
    assert isinstance(loaded.chat_template, Llama3ChatFormat)
    text = "Hello, world! 中文"
    assert loaded.tokenizer.encode(text) == meta_tokenizer().encode(text, bos=True, eos=False)
    ids = loaded.chat_template.prompt_ids([{"role": "user", "content": "Hi"}], loaded.tokenizer)
    assert len(list(greedy_tokens(loaded.model, ids, 4))) >= 1
    again = random_model.load_random_model(tiny_preset, device, seed=1).model.state_dict()
    other = random_model.load_random_model(tiny_preset, device, seed=2).model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, again[name]), name
    assert not torch.equal(loaded.model.lm_head.weight, other["lm_head.weight"])


def test_random_model_tokenizer_choices(tiny_preset, monkeypatch, tmp_path):
    explicit = random_model.load_random_model(tiny_preset, tokenizer_path=meta_tokenizer_path())
    assert explicit.tokenizer.encode("tokens") == meta_tokenizer().encode(
        "tokens", bos=True, eos=False
    )
    monkeypatch.setattr(random_model, "bundled_tokenizer_path", lambda: None)
    fallback = random_model.load_random_model(tiny_preset)
    assert fallback.tokenizer.encode("ab") == [128000, 97, 98]
    assert isinstance(fallback.chat_template, Llama3ChatFormat)
    small = tmp_path / "tokenizer.model"
    small.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    monkeypatch.setitem(
        PRESETS, "tiny", ModelConfig(**{**vars(PRESETS["tiny"]), "vocab_size": 300})
    )
    with pytest.raises(random_model.ModelFileError, match="do not fit"):
        random_model.load_random_model(tiny_preset, tokenizer_path=small)
