"""A tiny random gpt-oss checkpoint written by `transformers` (float32 experts), and the same
weights as a GGUF written with the `gguf` package under llama.cpp's gpt-oss names and
layout (its convert_hf_to_gguf.py `GptOssModel`): stacked experts split into gate, up and
down stacks with their biases, gate and up taken from transformers' alternate columns,
sinks as `attn_sinks.weight`, the norm before the experts as `post_attention_norm`."""

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from transformers import GptOssConfig, GptOssForCausalLM

from tests.tiny_families import add_vocabulary, save_randomised

# 8 experts of which each token picks 2, a window far shorter than the prompts, two layers
# (windowed, then full), YaRN as gpt-oss's config sets it.
SHAPE = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def make_tiny_gpt_oss(directory: Path, seed: int = 0) -> torch.nn.Module:
    """Every parameter random, biases, sinks and norm gains included."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**SHAPE)).eval()
    return save_randomised(model, directory, _spread)


def _spread(name: str) -> float | bool:
    """Routers with clear winners and sinks that matter; gates and ups past the limit of 7."""
    if "router" in name or "sinks" in name:
        return 1.0
    return 0.8 if name.endswith("experts.gate_up_proj") else False


_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}


def _tensors(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    name = name.removeprefix("model.")
    glob = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if name in glob or name == "lm_head.weight":
        return [(glob.get(name, "output.weight"), data)]
    _, layer, rest = name.split(".", 2)
    blk = f"blk.{layer}"
    if rest == "self_attn.sinks":
        return [(f"{blk}.attn_sinks.weight", data)]
    if rest.startswith("mlp.experts."):
        part = rest.removeprefix("mlp.experts.")
        kind = "bias" if part.endswith("_bias") else "weight"
        if kind == "weight":
            data = data.swapaxes(-1, -2)  # [experts, out, in], as a linear layer's weight
        if part.startswith("down_proj"):
            return [(f"{blk}.ffn_down_exps.{kind}", data.copy())]
        return [
            (f"{blk}.ffn_gate_exps.{kind}", data[:, ::2].copy()),
            (f"{blk}.ffn_up_exps.{kind}", data[:, 1::2].copy()),
        ]
    part, kind = rest.rsplit(".", 1)
    return [(f"{blk}.{_NAMES[part]}.{kind}", data)]


def write_gpt_oss_gguf(
    model: torch.nn.Module,
    hf_dir: Path,
    path: Path,
    types: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """float32 tensors, those named in `types` quantised by the `gguf` package."""
    c = model.config
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    add_vocabulary(writer, hf_dir, "gpt2", "gpt-2")
    for name, tensor in model.state_dict().items():
        for gguf_name, data in _tensors(name, tensor.float().numpy()):
            qtype = (types or {}).get(gguf_name)
            if qtype is None:
                writer.add_tensor(gguf_name, data)
            else:
                writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
