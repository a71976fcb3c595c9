"""`Bert`: the bidirectional encoder of BERT-family sentence embedders (all-MiniLM,
BGE, E5 and their kin), with Hugging Face's parameter names.

Every token attends to every other token of its sequence, so a sequence is computed
whole in one forward and nothing is cached: there is no KV cache, no chunking and no
decode. Sequences of a batch are padded to the longest and padding is masked out of
the keys; padded rows are dropped before pooling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.errors import ModelFileError, UnsupportedModelError

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_position: int
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str) -> BertConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
                "supported (only absolute)"
            )
        act = hf.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported")
        try:
            config = cls(
                vocab_size=int(hf["vocab_size"]),
                dim=int(hf["hidden_size"]),
                n_layers=int(hf["num_hidden_layers"]),
                n_heads=int(hf["num_attention_heads"]),
                ffn_dim=int(hf["intermediate_size"]),
                max_position=int(hf["max_position_embeddings"]),
                type_vocab_size=int(hf.get("type_vocab_size", 2)),
                norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                hidden_act=act,
            )
        except KeyError as exc:
            raise ModelFileError(f"{source}: config.json has no {exc.args[0]}") from None
        if config.dim % config.n_heads:
            raise ModelFileError(f"{source}: hidden_size is not a multiple of the heads")
        return config


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.attn_out = nn.Linear(c.dim, c.dim)
        self.attn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.ffn_in = nn.Linear(c.dim, c.ffn_dim)
        self.ffn_out = nn.Linear(c.ffn_dim, c.dim)
        self.ffn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, length, dim = h.shape
        q, k, v = (
            t.view(b, length, self.n_heads, -1).transpose(1, 2)
            for t in self.qkv(h).split(dim, dim=-1)
        )
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        a = a.transpose(1, 2).reshape(b, length, dim)
        h = self.attn_norm(h + self.attn_out(a))
        return self.ffn_norm(h + self.ffn_out(self.act(self.ffn_in(h))))


class Bert(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.position_embeddings = nn.Embedding(config.max_position, config.dim)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.dim)
        self.embed_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.n_layers))

    @torch.inference_mode()
    def forward(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Hidden states of every real token, the sequences one after another:
        [sum of lengths, dim]. Every sequence is one segment (token type 0)."""
        device = self.word_embeddings.weight.device
        lengths = [len(ids) for ids in token_ids]
        longest = max(lengths)
        ids = torch.zeros(len(token_ids), longest, dtype=torch.int64)
        for row, seq in enumerate(token_ids):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        ids = ids.to(device)
        real = (
            torch.arange(longest, device=device)[None, :]
            < torch.tensor(lengths, device=device)[:, None]
        )
        h = (
            self.word_embeddings(ids)
            + self.position_embeddings.weight[:longest][None]
            + self.token_type_embeddings.weight[0]
        )
        h = self.embed_norm(h)
        key_mask = real[:, None, None, :]  # True: attend
        for layer in self.layers:
            h = layer(h, key_mask)
        return h[real]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF BertModel names (a `bert.` prefix, as task heads save them, is dropped);
        the pooler and any task head are not part of an embedder and are skipped. Every
        parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        dim = self.config.dim
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            target = _our_name(name)
            if target is None:
                continue
            ours, row = target
            if ours not in params:
                raise ModelFileError(f"unexpected tensor {hf_name} in the checkpoint")
            param = params[ours]
            rows = param[row * dim : (row + 1) * dim] if row is not None else param
            if tuple(rows.shape) != tuple(tensor.shape):
                raise ModelFileError(
                    f"tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(rows.shape)}"
                )
            rows.copy_(tensor)
            seen.add(f"{ours}@{row}")
        expected = set()
        for name in params:
            if ".qkv." in name:
                expected |= {f"{name}@{r}" for r in range(3)}
            else:
                expected.add(f"{name}@None")
        missing = sorted(expected - seen)
        if missing:
            raise ModelFileError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
}
_LAYER = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("ffn_in", None),
    "output.dense": ("ffn_out", None),
    "output.LayerNorm": ("ffn_norm", None),
}


def _our_name(name: str) -> tuple[str, int | None] | None:
    """(our parameter, which third of the fused QKV or None); None for tensors an
    embedder does not use."""
    if name in _EMBEDDINGS:
        return _EMBEDDINGS[name], None
    if not name.startswith("encoder.layer."):
        return None  # position_ids, the pooler, task heads
    index, _, rest = name.removeprefix("encoder.layer.").partition(".")
    module, _, kind = rest.rpartition(".")
    if module not in _LAYER:
        return None
    ours, row = _LAYER[module]
    return f"layers.{index}.{ours}.{kind}", row
