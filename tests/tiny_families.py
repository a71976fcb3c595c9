"""Tiny random checkpoints of each supported family, written by `transformers` itself, and
the same weights written as a GGUF file with the `gguf` package under llama.cpp's tensor
names and layout. `transformers` loading that GGUF back (`gguf_file=`) is what checks the
writer; nothing here is produced by llamaserve's own code."""

import json
from collections.abc import Callable
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
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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
    # Mixtures of experts: 8 experts, 2 chosen per token, so most are left out. Qwen3-MoE's
    # middle layer keeps a dense MLP (`mlp_only_layers`), and it renormalises the chosen
    # weights, as every released one does and llama.cpp always does; OLMoE does not.
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            num_attention_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
        ),
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
}
# llama.cpp's converter stores Q/K rows as interleaved pairs for these (Trap 1).
PERMUTED = {"mistral": "llama", "mixtral": "llama"}
# llama.cpp's architecture names where they differ from transformers' model_type.
GGUF_ARCH = {**PERMUTED, "qwen3_moe": "qwen3moe"}
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
    # A router that picks clear winners.
    return save_randomised(model, directory, lambda name: name.endswith("mlp.gate.weight"))


def save_randomised(
    model: torch.nn.Module, directory: Path, wide: Callable[[str], float | bool]
) -> torch.nn.Module:
    """Norm gains around 1, the parameters `wide` names drawn with its spread (1.0 for
    True), the rest small; saved by `transformers` beside the tiny tokenizer."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = wide(name)
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif spread:
                p.normal_(0, float(spread))
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
    "mlp.gate": "ffn_gate_inp",
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


def _parts(name: str, data: np.ndarray, family: str) -> list[tuple[str, np.ndarray]]:
    """transformers 5 holds a layer's experts as two stacked tensors, gate and up in one;
    llama.cpp stores three, [n_expert, rows, columns] each."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [(_gguf_name(name, family), data)]
    layer = name.split(".")[2]
    if name.endswith("down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", data)]
    gate, up = np.split(data, 2, axis=1)
    return [
        (f"blk.{layer}.ffn_gate_exps.weight", gate.copy()),
        (f"blk.{layer}.ffn_up_exps.weight", up.copy()),
    ]


def _add_tensor(
    writer: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType | None
) -> None:
    if qtype is None:
        writer.add_tensor(name, data)
    elif qtype == GGMLQuantizationType.Q6_K:  # which the gguf package cannot write
        rows = q6_k.quantize(data.reshape(-1, data.shape[-1]))
        writer.add_tensor(name, rows.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def _interleave(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate-halves rows into llama.cpp's interleaved pairs, as its converter does."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_vocabulary(writer: GGUFWriter, hf_dir: Path, tokenizer_model: str, pre: str) -> None:
    """The tokenizer of `hf_dir` as a GGUF vocabulary."""
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


def write_gguf(
    model: torch.nn.Module,
    family: str,
    hf_dir: Path,
    path: Path,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt-2",
    types: dict[str, GGMLQuantizationType] | None = None,
    blocks: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """The model's weights as float32 GGUF tensors (those `types` names quantised by the
    `gguf` package; Q6_K by tests/q6_k.py; those `blocks` names replaced by the blocks given,
    of a type nothing here writes, such as Q4_K), its config as `<arch>.*` metadata and the
    tokenizer of `hf_dir` as a GGUF vocabulary (`gpt2`, byte-level BPE, unless the test
    names another)."""
    c = model.config
    arch = GGUF_ARCH.get(family, family)
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
    n_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        expert_ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        writer.add_expert_feed_forward_length(expert_ffn)
    add_vocabulary(writer, hf_dir, tokenizer_model, pre)
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
        for gguf_name, part in _parts(name, data, family):
            if gguf_name in (blocks or {}):
                raw, qtype = (blocks or {})[gguf_name]
                writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            else:
                _add_tensor(writer, gguf_name, part, (types or {}).get(gguf_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
