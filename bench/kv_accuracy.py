"""What a KV-cache format costs in accuracy, against a float32 cache on the same float32
model: the figures behind docs/kv-cache.md, run by `make accuracy` with `--kv-cache`.

    python -m bench.accuracy --kv-cache bfloat16 int8 int8-block --contexts 512 4096

A long text (this repository's docs pages, joined) is fed teacher-forced in chunks of
512 tokens, so each chunk attends to the earlier ones through the cache as a chunked
prefill does, and every position's next-token distribution is compared with the one a
float32 cache gives: how often the most likely token agrees, and the mean KL divergence
(float32 || format), over all positions and over the last quarter (the longest contexts).
Weights stay in float32, so the differences are the cache's alone.

`int8` is the engine's cache (model/network/kv_int8.py, a scale per token and KV head).
The others are simulated on a float32 cache (`SIMULATED`): `int8-block`, one scale per
block of 16 tokens and KV head, at its most favourable (each block's scale is its own
largest value, as if it were known before the block's first token is written; a block
filled by decodes would not know it); `int8-keys` and `int8-values`, only K or only V
rounded as the engine rounds them; `int8-g16`, a scale per token and 16 values of a head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from model.attention.torch_ref import TorchRefBackend
from model.loader import LoadedModel
from model.network.batch import Batch
from model.network.kv_int8 import QMAX
from model.network.paged_cache import PagedKVCache

CHUNK = 512
BLOCK = 16
DOCS = Path(__file__).resolve().parent.parent / "docs"
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass
class KvAgreement:
    positions: int
    top1: int
    mean_kl: float
    tail_top1: int  # over the last quarter of the positions
    tail_positions: int
    tail_mean_kl: float


def long_text_ids(loaded: LoadedModel, tokens: int) -> list[int]:
    """The first `tokens` + 1 tokens of the docs pages joined in name order."""
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")))
    ids = loaded.tokenizer.encode(text)
    if len(ids) <= tokens:
        raise ValueError(f"the docs hold {len(ids)} tokens, fewer than {tokens + 1}")
    return ids[: tokens + 1]


# The alternatives simulated on a float32 cache: (K rounded, V rounded, tokens per scale,
# values of a head per scale); the engine's int8 is (True, True, 1, head_dim).
SIMULATED = {
    "int8-block": (True, True, BLOCK, None),  # a scale per block of 16 tokens and KV head
    "int8-keys": (True, False, 1, None),  # K alone rounded, a scale per token
    "int8-values": (False, True, 1, None),  # V alone
    "int8-g16": (True, True, 1, 16),  # a scale per token and 16 values of a head
}


class SimulatedInt8Backend(TorchRefBackend):
    """The reference backend over a float32 cache, the new K and/or V rounded to int8
    before they are written, one float32 scale per `tokens` x `dims` of a KV head (the
    engine's is rounded to bf16, a difference of at most 2^-9 in the scale). Exact only
    where whole blocks are written at once, as the chunks here are."""

    name = "int8_simulation"

    def __init__(self, keys: bool, values: bool, tokens: int, dims: int | None) -> None:
        self.keys, self.values, self.tokens, self.dims = keys, values, tokens, dims

    def forward(self, q, k, v, k_cache, v_cache, batch, plan, scale, window=None):
        if self.keys:
            k = _rounded(k, self.tokens, self.dims or k.shape[2])
        if self.values:
            v = _rounded(v, self.tokens, self.dims or v.shape[2])
        return super().forward(q, k, v, k_cache, v_cache, batch, plan, scale, window)


def _rounded(x: torch.Tensor, tokens: int, dims: int) -> torch.Tensor:
    count, n_kv, head_dim = x.shape
    groups = x.float().reshape(-1, tokens, n_kv, head_dim // dims, dims)
    scale = groups.abs().amax(dim=(1, 4), keepdim=True) / QMAX  # in float32
    rounded = torch.round(groups / scale.clamp_min(1e-30)).clamp(-QMAX, QMAX) * scale
    return rounded.reshape(count, n_kv, head_dim).to(x.dtype)


def chunk_logprobs(loaded: LoadedModel, ids: list[int], kind: str) -> Iterator[torch.Tensor]:
    """log-softmax of the next-token logits at every position but the last, chunk by
    chunk, on a cache of `kind`."""
    model = loaded.model
    blocks = -(-len(ids) // BLOCK)
    dtype = CACHE_DTYPES.get(kind, torch.float32)
    cache = PagedKVCache.allocate(model.config, blocks, BLOCK, dtype)
    table = list(range(blocks))
    simulated = SIMULATED.get(kind)
    backend = SimulatedInt8Backend(*simulated) if simulated else TorchRefBackend()
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start : min(start + CHUNK, len(ids) - 1)]
        batch = Batch.build([chunk], [start], [table], BLOCK, all_logits=True)
        # The backend is set per chunk: the kinds' chunks are computed in turn.
        saved, model.attention = model.attention, backend
        try:
            logits = model(batch, cache)
        finally:
            model.attention = saved
        yield torch.log_softmax(logits.float(), dim=-1)


def compare_caches(loaded: LoadedModel, ids: list[int], kinds: list[str]) -> list[KvAgreement]:
    """Each of `kinds` against a float32 cache, position by position, all chunk by chunk
    side by side so that float32's distributions are computed once and never all held."""
    positions = len(ids) - 1
    tail_start = positions - positions // 4
    sums = [[0, 0, 0.0, 0.0] for _ in kinds]  # top-1, tail top-1, KL, tail KL
    offset = 0
    streams = [chunk_logprobs(loaded, ids, kind) for kind in ["float32", *kinds]]
    for ref, *others in zip(*streams, strict=True):
        tail = torch.arange(offset, offset + ref.shape[0]) >= tail_start
        for total, got in zip(sums, others, strict=True):
            agree = ref.argmax(-1) == got.argmax(-1)
            each_kl = (ref.exp() * (ref - got)).sum(-1)
            total[0] += int(agree.sum())
            total[1] += int(agree[tail].sum())
            total[2] += float(each_kl.sum())
            total[3] += float(each_kl[tail].sum())
        offset += ref.shape[0]
    tail_positions = positions - tail_start
    return [
        KvAgreement(positions, t[0], t[2] / positions, t[1], tail_positions, t[3] / tail_positions)
        for t in sums
    ]


def report(loaded: LoadedModel, kinds: list[str], contexts: list[int]) -> None:
    header = "cache", "context", "top-1 agrees", "mean KL", "last quarter: top-1", "mean KL"
    print("{:<12} {:>8} {:>16} {:>10} {:>22} {:>10}".format(*header))
    for context in contexts:
        if context % CHUNK:
            raise ValueError(f"contexts are whole chunks of {CHUNK} tokens, not {context}")
        ids = long_text_ids(loaded, context)
        for kind, a in zip(kinds, compare_caches(loaded, ids, kinds), strict=True):
            print(
                f"{kind:<12} {context:>8} {a.top1:>7} / {a.positions:<6} {a.mean_kl:>10.6f} "
                f"{a.tail_top1:>12} / {a.tail_positions:<6} {a.tail_mean_kl:>10.6f}",
                flush=True,
            )
