"""Meta's own code as the reference for Llama 3: the tokenizer, `ChatFormat` and the reference
`Transformer` from the PyPI package `llama-models`, and tiny Llama 3-style checkpoints written in
Meta's layout (by Meta's `Transformer`) and in HF's (by `transformers`, after a Q/K permutation
written here, independently of llamaserve's loader). Nothing here uses llamaserve's code.

Meta's `Transformer` imports fairscale for model parallelism; with one rank its parallel layers
are plain `nn.Linear`/`nn.Embedding`, so stand-ins with those semantics are put in `sys.modules`
while its module is imported, and taken out again afterwards.
"""

import functools
import importlib
import importlib.resources
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from llama_models.datatypes import RawMessage, RawTextItem
from llama_models.llama3.chat_format import ChatFormat
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["ChatFormat", "MetaTokenizer", "RawMessage", "RawTextItem"]

LLAMA3_VOCAB = 128256


def meta_tokenizer_path() -> Path:
    return Path(str(importlib.resources.files("llama_models.llama3") / "tokenizer.model"))


@functools.cache
def meta_tokenizer() -> MetaTokenizer:
    return MetaTokenizer(meta_tokenizer_path())


class _ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, **_: Any) -> None:
        super().__init__(in_features, out_features, bias=bias)


class _VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, **_: Any) -> None:
        super().__init__(num_embeddings, embedding_dim)


def _fairscale_single_rank() -> dict[str, types.ModuleType]:
    modules = {
        name: types.ModuleType(name)
        for name in (
            "fairscale",
            "fairscale.nn",
            "fairscale.nn.model_parallel",
            "fairscale.nn.model_parallel.initialize",
            "fairscale.nn.model_parallel.layers",
        )
    }
    modules["fairscale.nn.model_parallel.initialize"].get_model_parallel_world_size = lambda: 1
    layers = modules["fairscale.nn.model_parallel.layers"]
    layers.ColumnParallelLinear = _ColumnParallelLinear
    layers.RowParallelLinear = _ColumnParallelLinear
    layers.VocabParallelEmbedding = _VocabParallelEmbedding
    modules["fairscale"].nn = modules["fairscale.nn"]
    modules["fairscale.nn"].model_parallel = modules["fairscale.nn.model_parallel"]
    parallel = modules["fairscale.nn.model_parallel"]
    parallel.initialize = modules["fairscale.nn.model_parallel.initialize"]
    parallel.layers = layers
    return modules


@functools.cache
def meta_model_module() -> types.ModuleType:
    """`llama_models.llama3.model` (Meta's reference Transformer), imported over one rank."""
    stubs = _fairscale_single_rank()
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        return importlib.import_module("llama_models.llama3.model")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = module


# A tiny Llama 3: GQA (8 query heads on 2 KV heads), the real 128,256-token vocabulary, Llama 3.1
# rope scaling, and Meta's multiple_of/ffn_dim_multiplier deciding the FFN width.
TINY_PARAMS = {
    "dim": 128,
    "n_layers": 2,
    "n_heads": 8,
    "n_kv_heads": 2,
    "vocab_size": LLAMA3_VOCAB,
    "multiple_of": 32,
    "ffn_dim_multiplier": 1.3,
    "norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_scaled_rope": True,
}


def make_meta_model(params: dict[str, Any], seed: int = 0, max_seq_len: int = 512) -> nn.Module:
    """Meta's reference Transformer with random weights that bf16 represents exactly, so a bf16
    checkpoint of it holds the same numbers as the fp32 model."""
    module = meta_model_module()
    torch.manual_seed(seed)
    model = module.Transformer(
        module.ModelArgs(**params, max_batch_size=1, max_seq_len=max_seq_len)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))  # distinct gains catch swapped norms
            else:
                p.normal_(0, 0.08)
            p.copy_(p.bfloat16().float())
    return model.eval()


def meta_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return model.forward(torch.tensor([ids]), start_pos=0)[0].float()


# Which dimension fairscale splits over model-parallel ranks (None: every rank has a copy).
_SPLIT_DIM = {
    "tok_embeddings": 0,
    "output": 0,
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "w1": 0,
    "w3": 0,
    "wo": 1,
    "w2": 1,
}


def save_meta_checkpoint(
    model: nn.Module,
    params: dict[str, Any],
    directory: Path,
    ranks: int = 1,
    drop: tuple[str, ...] = (),
) -> None:
    """`params.json`, `consolidated.NN.pth` (bf16, one file per rank, without the tensors named
    in `drop`) and `tokenizer.model`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "params.json").write_text(json.dumps(params))
    (directory / "tokenizer.model").write_bytes(meta_tokenizer_path().read_bytes())
    state = {k: v.bfloat16() for k, v in model.state_dict().items() if k not in drop}
    for rank in range(ranks):
        shard = {}
        for name, tensor in state.items():
            split = _SPLIT_DIM.get(name.split(".")[-2])
            piece = tensor if split is None else tensor.chunk(ranks, dim=split)[rank]
            shard[name] = piece.clone()  # a saved view would drag its whole storage along
        torch.save(shard, directory / f"consolidated.{rank:02d}.pth")


def _halves_order(n_heads: int, head_dim: int) -> list[int]:
    """HF row h*d + j*d/2 + i holds Meta row h*d + 2i + j: Meta rotates pairs (2i, 2i+1),
    HF rotates (i, i + d/2)."""
    return [
        h * head_dim + 2 * i + j
        for h in range(n_heads)
        for j in (0, 1)
        for i in range(head_dim // 2)
    ]


def meta_to_hf_state(model: nn.Module, params: dict[str, Any]) -> dict[str, torch.Tensor]:
    head_dim = params["dim"] // params["n_heads"]
    q_order = _halves_order(params["n_heads"], head_dim)
    k_order = _halves_order(params["n_kv_heads"], head_dim)
    state = model.state_dict()
    hf = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["output.weight"],
    }
    for i in range(params["n_layers"]):
        meta, ours = f"layers.{i}.", f"model.layers.{i}."
        hf[ours + "self_attn.q_proj.weight"] = state[meta + "attention.wq.weight"][q_order]
        hf[ours + "self_attn.k_proj.weight"] = state[meta + "attention.wk.weight"][k_order]
        hf[ours + "self_attn.v_proj.weight"] = state[meta + "attention.wv.weight"]
        hf[ours + "self_attn.o_proj.weight"] = state[meta + "attention.wo.weight"]
        hf[ours + "mlp.gate_proj.weight"] = state[meta + "feed_forward.w1.weight"]
        hf[ours + "mlp.up_proj.weight"] = state[meta + "feed_forward.w3.weight"]
        hf[ours + "mlp.down_proj.weight"] = state[meta + "feed_forward.w2.weight"]
        hf[ours + "input_layernorm.weight"] = state[meta + "attention_norm.weight"]
        hf[ours + "post_attention_layernorm.weight"] = state[meta + "ffn_norm.weight"]
    return hf


def save_hf_checkpoint(model: nn.Module, params: dict[str, Any], directory: Path) -> nn.Module:
    """The same network as an HF checkpoint written by `transformers`; returns its model."""
    config = LlamaConfig(
        hidden_size=params["dim"],
        # Meta's FeedForward decides the width; read it off the built module.
        intermediate_size=model.layers[0].feed_forward.w1.weight.shape[0],
        num_hidden_layers=params["n_layers"],
        num_attention_heads=params["n_heads"],
        num_key_value_heads=params["n_kv_heads"],
        vocab_size=params["vocab_size"],
        rms_norm_eps=params["norm_eps"],
        rope_theta=params["rope_theta"],
        # Meta's reference code scales with these constants whenever use_scaled_rope is set.
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(meta_to_hf_state(model, params), strict=True)
    hf.save_pretrained(directory)
    return hf
