"""Greedy generation of one sequence, straight on the model and a private paged cache.

The reference path for the `generate` demo and for tests: no scheduler, no sampling
options, blocks handed out consecutively. Serving goes through the engine instead.

It must never grow sampling options or scheduling: it is the loop the engine is checked
against.
"""

from collections.abc import Iterator

import torch

from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache


def greedy_tokens(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] | set[int] = frozenset(),
    block_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> Iterator[int]:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    device = model.device
    dtype = kv_dtype or model.dtype  # torch.int8: the int8 cache (model/network/kv_int8.py)
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // block_size)
    cache = PagedKVCache.allocate(model.config, num_blocks, block_size, dtype, device)
    table = list(range(num_blocks))
    new, computed = list(prompt_ids), 0
    for _ in range(max_new_tokens):
        logits = model(Batch.build([new], [computed], [table], block_size, device), cache)
        token = int(torch.argmax(logits[0]).item())
        yield token
        if token in stop_ids:
            return
        computed += len(new)
        new = [token]
