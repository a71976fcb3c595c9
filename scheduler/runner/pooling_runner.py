"""Runners of embedding work: token ids of whole inputs in, one pooled float32 vector per
input out. `EncoderRunner` drives a bidirectional encoder (model/encoder/bert.py), which
keeps nothing between calls; `CrossEncoderRunner` the same encoder with a classifier head,
scoring text pairs. `DecoderPoolingRunner` drives a served decoder family
(`--task embed`): its attention writes K/V to a paged cache, so it runs each step in a
scratch cache of its own that no request holds once the step is done.

Like `ModelRunner`, they never change request state; the pooling engine does. Both
answer `PoolingRunner` (scheduler/engine/pooling_engine.py).
"""

from __future__ import annotations

import numpy as np

from model.encoder.bert import Bert
from model.encoder.classifier import ClassifierHead
from model.encoder.pooling import PoolingConfig, pool
from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache


class EncoderRunner:
    def __init__(self, model: Bert, pooling: PoolingConfig, max_model_len: int) -> None:
        self.model = model
        self.pooling = pooling
        self.max_model_len = max_model_len
        self.dim = model.config.dim

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> np.ndarray:
        hidden = self.model(token_ids, token_type_ids)
        return pool(hidden, [len(t) for t in token_ids], self.pooling).cpu().numpy()


class CrossEncoderRunner:
    """A cross-encoder: each input is a text pair in one sequence, and its "vector" is the
    classifier's scores after the activation ([num_labels], one for a reranker)."""

    def __init__(self, model: Bert, head: ClassifierHead, max_model_len: int) -> None:
        self.model = model
        self.head = head
        self.max_model_len = max_model_len
        self.dim = head.classifier.out_features

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> np.ndarray:
        hidden = self.model(token_ids, token_type_ids)
        return self.head(hidden, [len(t) for t in token_ids]).cpu().numpy()


class DecoderPoolingRunner:
    def __init__(
        self,
        model: Llama,
        pooling: PoolingConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        block_size: int = 16,
    ) -> None:
        self.model = model
        self.pooling = pooling
        self.max_model_len = max_model_len
        self.dim = model.config.dim
        self.block_size = block_size
        self.device = model.device
        # Enough for the largest step the engine forms: a full token budget spread over
        # max_num_seqs inputs (each rounds up to a block), or one input of the longest
        # length alone. On a CPU the pages of blocks never written are never resident.
        blocks = max(
            -(-max_model_len // block_size),
            -(-max_num_batched_tokens // block_size) + max_num_seqs,
        )
        self.kv_cache = PagedKVCache.allocate(
            model.config, blocks, block_size, model.dtype, model.device
        )

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> np.ndarray:
        """A decoder has no segments: `token_type_ids` is never given (the routes score
        pairs only on a cross-encoder)."""
        tables, start = [], 0
        for ids in token_ids:
            count = -(-len(ids) // self.block_size)
            tables.append(list(range(start, start + count)))
            start += count
        batch = Batch.build(
            token_ids,
            [0] * len(token_ids),
            tables,
            self.block_size,
            self.device,
            null_block=self.kv_cache.null_block,
        )
        hidden = self.model.hidden_states(batch, self.kv_cache)
        return pool(hidden, [len(t) for t in token_ids], self.pooling).cpu().numpy()
