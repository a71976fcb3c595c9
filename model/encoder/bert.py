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

    def forward(self, h: torch.Tensor, groups: list[_Group]) -> torch.Tensor:
        qkv = self.qkv(h)
        a = torch.empty_like(h)
        for g in groups:
            b, length = g.real.shape
            q, k, v = (
                t.reshape(b, length, self.n_heads, -1).transpose(1, 2)
                for t in qkv[g.rows].split(h.shape[1], dim=-1)
            )
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.real[:, None, None, :])
            a[g.rows_real] = out.transpose(1, 2).reshape(b, length, -1)[g.real]
        h = self.attn_norm(h + self.attn_out(a))
        return self.ffn_norm(h + self.ffn_out(self.act(self.ffn_in(h))))


@dataclass
class _Group:
    """Sequences whose attention runs as one padded batch: `rows` [b * longest] are the
    packed rows of their tokens (padding points at row 0 and is masked), `real` [b,
    longest] marks real tokens, `rows_real` the rows they fill back."""

    rows: torch.Tensor
    real: torch.Tensor
    rows_real: torch.Tensor


# A group of sequences may pad up to this share over its real tokens before a new group
# starts: attention of a short sequence padded to a long one's length costs a long one's.
PADDING_SLACK = 1.25


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in groups, shortest first; in each, the longest times the
    count stays within PADDING_SLACK of the sum of lengths."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= PADDING_SLACK * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


def _groups(lengths: list[int], device: torch.device) -> list[_Group]:
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    result = []
    for members in length_groups(lengths):
        longest = max(lengths[i] for i in members)
        offsets = torch.arange(longest)
        real = offsets[None, :] < torch.tensor([lengths[i] for i in members])[:, None]
        rows = torch.tensor([starts[i] for i in members])[:, None] + offsets[None, :]
        rows = torch.where(real, rows, 0)
        result.append(_Group(rows.flatten().to(device), real.to(device), rows[real].to(device)))
    return result


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
    def forward(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Hidden states of every token, the sequences one after another: [sum of
        lengths, dim]. `token_type_ids` says each token's segment (a cross-encoder's pair
        is two); None: every sequence is one segment (type 0). The linear layers run on the
        packed tokens, so no padding costs them anything; only attention pads, in groups of
        sequences of similar length."""
        device = self.word_embeddings.weight.device
        lengths = [len(ids) for ids in token_ids]
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in lengths])
        if token_type_ids is None:
            segments = self.token_type_embeddings.weight[0]
        else:
            types = torch.tensor([t for seq in token_type_ids for t in seq], dtype=torch.int64)
            segments = self.token_type_embeddings(types.to(device))
        h = (
            self.word_embeddings(ids.to(device))
            + self.position_embeddings(positions.to(device))
            + segments
        )
        h = self.embed_norm(h)
        groups = _groups(lengths, device)
        for layer in self.layers:
            h = layer(h, groups)
        return h

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF BertModel names (a `bert.` prefix, as task heads save them, is dropped);
        the pooler and any task head are not part of the encoder and are skipped (a
        cross-encoder's go to its `ClassifierHead`). Every
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
