"""Start-up of a server whose model embeds or scores: which task a model serves (`--task`,
or auto from the checkpoint), and the pooling engine, runner and `EmbeddingSpec` for an
encoder directory, a cross-encoder directory (which scores text pairs) or a decoder family
served with `--task embed`.

The generating path stays launch.py's; this module only adds the other one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from model.checkpoint.pypi_models import resolve_model_path
from model.encoder.checkpoint import is_encoder_dir, load_encoder, matryoshka_dimensions
from model.encoder.pooling import PoolingConfig
from model.loader import LoadedModel, resolve_device
from model.text.tokenizer import Tokenizer
from model.text.wordpiece import WordPieceTokenizer
from scheduler import (
    CrossEncoderRunner,
    DecoderPoolingRunner,
    EncoderRunner,
    PoolingEngine,
    SchedulerConfig,
)
from server.startup.config import ServeConfig
from server.startup.flags import UsageError
from server.state import EmbeddingSpec

logger = logging.getLogger("llamaserve.server")

# Tokens one embedding step may take unless --max-num-batched-tokens says otherwise: a
# step holds no stream back (embedding requests have no decodes waiting on it), so it is
# as large as a batch of 32 inputs at an encoder's usual 256-token limit.
EMBED_MAX_NUM_BATCHED_TOKENS = 8192
DECODER_POOLING = PoolingConfig(mode="last", normalize=True)


@dataclass
class EmbeddingServer:
    engine: PoolingEngine
    tokenizer: Tokenizer | WordPieceTokenizer
    name: str
    vocab_size: int
    spec: EmbeddingSpec | None  # None: a cross-encoder, which scores and embeds nothing


def embedding_kind(config: ServeConfig) -> str | None:
    """ "encoder" or "decoder" when the server embeds, None when it generates; refuses an
    encoder asked to generate."""
    path = resolve_model_path(config.model) if config.model and not config.random_weights else None
    encoder = path is not None and is_encoder_dir(path)
    if encoder and config.task == "generate":
        raise UsageError(f"{path} is an encoder embedding model: it cannot serve --task generate")
    if config.task == "embed" or encoder:
        if config.parallel.tensor_parallel_size > 1:
            raise UsageError("--task embed runs on one device: drop --tensor-parallel-size")
        if config.engine.speculative is not None:
            raise UsageError("--speculative-config speeds up generation: drop it to embed")
        return "encoder" if encoder else "decoder"
    if config.pooling is not None:
        raise UsageError("--pooling applies only to a model that embeds (--task embed)")
    return None


def build_embedding_server(config: ServeConfig, loaded: LoadedModel | None) -> EmbeddingServer:
    """`loaded`: a decoder already loaded (by launch.py's `load`); None for an encoder."""
    budget = config.engine.max_num_batched_tokens or EMBED_MAX_NUM_BATCHED_TOKENS
    if loaded is None:
        encoder = load_encoder(
            resolve_model_path(config.model or ""),
            dtype=config.dtype,
            device=resolve_device(config.device),
            max_model_len=config.engine.max_model_len,
        )
        pooling = encoder.pooling.overridden(config.pooling)
        runner: EncoderRunner | CrossEncoderRunner | DecoderPoolingRunner
        if encoder.head is not None:
            if config.pooling is not None:
                raise UsageError("--pooling: a cross-encoder pools its [CLS] token by its head")
            runner = CrossEncoderRunner(encoder.model, encoder.head, encoder.max_model_len)
        else:
            runner = EncoderRunner(encoder.model, pooling, encoder.max_model_len)
        tokenizer: Tokenizer | WordPieceTokenizer = encoder.tokenizer
        name, vocab_size = encoder.name, encoder.model.config.vocab_size
        matryoshka = encoder.matryoshka
    else:
        pooling = DECODER_POOLING.overridden(config.pooling)
        max_len = min(
            config.engine.max_model_len or loaded.config.max_position, loaded.config.max_position
        )
        runner = DecoderPoolingRunner(
            loaded.model,
            pooling,
            max_len,
            budget,
            config.engine.max_num_seqs,
            config.engine.block_size,
        )
        tokenizer, name, vocab_size = loaded.tokenizer, loaded.name, loaded.config.vocab_size
        matryoshka = matryoshka_dimensions(_hf_config(loaded.path))
        logger.info("serving %s as an embedder: %s pooling", name, pooling.mode)
    engine = PoolingEngine(
        runner,
        SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_seqs=config.engine.max_num_seqs,
            max_num_batched_tokens=budget,
            max_waiting=config.engine.max_waiting,
        ),
    )
    spec = None
    if not isinstance(runner, CrossEncoderRunner):
        spec = EmbeddingSpec(dim=runner.dim, normalize=pooling.normalize, matryoshka=matryoshka)
    return EmbeddingServer(engine, tokenizer, name, vocab_size, spec)


def _hf_config(path: Path) -> dict:
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return {}
    try:
        return json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
