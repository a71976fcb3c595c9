"""Which part of the model a rank holds, and how each checkpoint tensor is cut for it.

Column-parallel (output rows split): Q/K/V by heads, gate/up by FFN rows; row-parallel
(input columns split, summed by an all-reduce): O and down; a mixture of experts is split
the same way inside each expert (every rank holds every expert's slice of FFN rows and the
whole router, so routing needs no communication and the experts' work is shared evenly
whichever ones tokens pick); OLMoE's whole-projection Q/K norms follow their heads' rows
(model/network/decoder_layer.py adds up their sums of squares); vocabulary-parallel: the
embedding and the output projection by vocabulary rows. Rank r holds query heads
[r * n_heads / N, (r + 1) * n_heads / N) and the KV heads those heads read; where there
are fewer KV heads than ranks, each KV head is replicated on the N / n_kv_heads ranks whose
query heads share it (as vLLM does).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from model.config import ModelConfig
from model.errors import UnsupportedModelError

# An expert's gate/up/down as transformers saves it (Mixtral's as w1/w3/w2).
_EXPERT = re.compile(
    r"\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_KV_ROWS = tuple(f"self_attn.{p}_proj.{kind}" for p in "kv" for kind in ("weight", "bias"))


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int

    def check(self, config: ModelConfig) -> None:
        """One sentence when the model's shapes do not split N ways."""
        n = self.size
        if config.attention_sinks or config.expert_bias:
            # Each rank would need its heads' sinks and the biases added once, not per rank.
            raise UnsupportedModelError(
                f"tensor parallelism does not split {config.architecture!r} models yet"
            )
        if config.n_heads % n:
            raise UnsupportedModelError(
                f"--tensor-parallel-size {n} does not divide the model's {config.n_heads} "
                "query heads"
            )
        if config.n_kv_heads % n and n % config.n_kv_heads:
            raise UnsupportedModelError(
                f"--tensor-parallel-size {n} neither divides the model's {config.n_kv_heads} "
                "KV heads nor is a multiple of them"
            )
        if config.ffn_dim % n:
            raise UnsupportedModelError(
                f"--tensor-parallel-size {n} does not divide the model's FFN size {config.ffn_dim}"
            )
        if config.expert_ffn_dim % n:
            raise UnsupportedModelError(
                f"--tensor-parallel-size {n} does not divide the model's expert FFN size "
                f"{config.expert_ffn_dim}"
            )

    @staticmethod
    def same_format_on_every_rank(
        dtype: torch.dtype | str, quantization: str | None, device: str
    ) -> tuple[torch.dtype | str, str | None]:
        """ "auto" times the machine, and ranks could time differently: under tensor
        parallelism it is float32 on a CPU, bfloat16 on CUDA, unquantised."""
        if dtype == "auto":
            dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
        if quantization in ("auto", "none"):
            quantization = None
        return dtype, quantization

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's layers have; the vocabulary stays whole (the logits are)."""
        self.check(config)
        return dataclasses.replace(
            config,
            n_heads=config.n_heads // self.size,
            n_kv_heads=max(1, config.n_kv_heads // self.size),
            ffn_dim=config.ffn_dim // self.size,
            expert_ffn_dim=config.expert_ffn_dim // self.size,
        )

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows; every rank holds the same count
        (the last pads with zero rows), so gathered logits line up."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        if config.n_kv_heads >= self.size:
            per_rank = config.n_kv_heads // self.size
            return self.rank * per_rank, (self.rank + 1) * per_rank
        first = self.rank * config.n_kv_heads // self.size
        return first, first + 1

    def shard(self, name: str, tensor: Any, config: ModelConfig) -> torch.Tensor:
        """This rank's part of the HF-named tensor `name` (HF layout: [out, in]). `tensor`
        may also be a lazy slice that reads only what it is indexed with (safetensors')."""
        n, r, hd = self.size, self.rank, config.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            per_rank = config.q_size // n
            return tensor[r * per_rank : (r + 1) * per_rank]
        if name.endswith(_KV_ROWS):
            first, end = self.kv_heads(config)
            return tensor[first * hd : end * hd]
        if config.qk_norm_whole and name.endswith("self_attn.q_norm.weight"):
            per_rank = config.q_size // n
            return tensor[r * per_rank : (r + 1) * per_rank]
        if config.qk_norm_whole and name.endswith("self_attn.k_norm.weight"):
            first, end = self.kv_heads(config)
            return tensor[first * hd : end * hd]
        if expert := _EXPERT.search(name):
            per_rank = config.expert_ffn_dim // n
            cut = slice(r * per_rank, (r + 1) * per_rank)
            return tensor[:, cut] if expert.group(1) in ("down_proj", "w2") else tensor[cut]
        if name.endswith("self_attn.o_proj.weight"):
            per_rank = config.q_size // n
            return tensor[:, r * per_rank : (r + 1) * per_rank]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            per_rank = config.ffn_dim // n
            return tensor[r * per_rank : (r + 1) * per_rank]
        if name.endswith("mlp.down_proj.weight"):
            per_rank = config.ffn_dim // n
            return tensor[:, r * per_rank : (r + 1) * per_rank]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, end = self.vocab_rows(config.vocab_size)
            rows = tensor[start:end]
            if rows.shape[0] < end - start:
                pad = rows.new_zeros(end - start - rows.shape[0], rows.shape[1])
                rows = torch.cat([rows, pad])
            return rows
        return tensor[:]  # norms (per-head Q/K norms too): every rank holds them whole

    def cut(self, config: ModelConfig) -> Any:
        """`shard` as a reader's per-tensor cut: (name, tensor or lazy slice) -> shard."""
        return partial(_cut, self, config)

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Cuts each tensor as it streams in: a rank never holds more than its own shard
        plus the one tensor being read."""
        for name, tensor in weights:
            yield name, self.shard(name, tensor, config).contiguous()


def _cut(tp: TensorParallel, config: ModelConfig, name: str, tensor: Any) -> torch.Tensor:
    return tp.shard(name, tensor, config).contiguous()
