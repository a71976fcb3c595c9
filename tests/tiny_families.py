"""Tiny random checkpoints of each supported family, written by `transformers` itself, and
the same weights written as a GGUF file with the `gguf` package under llama.cpp's tensor
names and layout. `transformers` loading that GGUF back (`gguf_file=`) is what checks the
writer; nothing here is produced by llamaserve's own code."""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests import q6_k
from tests.tiny_models import write_tiny_tokenizer

SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # head_dim 128 (as in every Qwen3) while hidden_size / heads is 16: Qwen3 sets it on its
    # own, and transformers' GGUF reader assumes 128.
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(head_dim=128, num_attention_heads=4, tie_word_embeddings=False),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    # Six layers: the sixth is global, the others windowed, as llama.cpp fixes the pattern.
    # head_dim 256 as in every Gemma 3: GGUF has no query_pre_attn_scalar, and readers take
    # head_dim (llama.cpp) or 256 (transformers).
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            num_hidden_layers=6,
            head_dim=256,
            num_attention_heads=2,
            num_key_value_heads=1,
            query_pre_attn_scalar=256,
            sliding_window=8,
            rope_local_base_freq=10000.0,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
    ),
}
# llama.cpp's converter stores Q/K rows as interleaved pairs for these (Trap 1).
PERMUTED = {"mistral": "llama"}
# Gemma's four norms as transformers and llama.cpp name them; llama.cpp stores 1 + w.
GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def make_tiny(family: str, directory: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Every parameter random, biases and norm gains included, so that each one matters."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**SHAPE, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return model


_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str, family: str) -> str:
    name = name.removeprefix("model.")
    glob = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if name in glob or name == "lm_head.weight":
        return glob.get(name, "output.weight")
    _, layer, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    names = {**_LAYER, **GEMMA_NORMS} if family == "gemma3" else _LAYER
    return f"blk.{layer}.{names[part]}.{kind}"


def _interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate-halves rows into llama.cpp's interleaved pairs, as its converter does."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    model: torch.nn.Module,
    family: str,
    hf_dir: Path,
    path: Path,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt-2",
    types: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """The model's weights as float32 GGUF tensors (those `types` names quantised by the
    `gguf` package; Q6_K by tests/q6_k.py), its config as `<arch>.*` metadata and the
    tokenizer of `hf_dir` as a GGUF vocabulary (`gpt2`, byte-level BPE, unless the test
    names another)."""
    c = model.config
    arch = PERMUTED.get(family, family)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _interleave(data, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _interleave(data, c.num_key_value_heads)
        elif family == "gemma3" and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = _gguf_name(name, family)
        qtype = (types or {}).get(gguf_name)
        if qtype is None:
            writer.add_tensor(gguf_name, data)
        elif qtype == GGMLQuantizationType.Q6_K:  # which the gguf package cannot write
            writer.add_tensor(gguf_name, q6_k.quantize(data), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
