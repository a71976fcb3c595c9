"""Builds a ready server from `ServeConfig`: load the model, size the KV cache, start the
engine thread, wire the app; and runs it under uvicorn with a graceful shutdown.

It wires parts together and owns none of their state.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import FastAPI

from model.config import ModelConfig
from model.errors import ModelFileError, UnsupportedFormatError, UnsupportedModelError
from model.loader import LoadedModel, load_model, resolve_device
from model.parallel.plan import TensorParallel
from model.plan import tuning
from model.random_model import load_random_model
from scheduler import (
    AsyncEngine,
    Engine,
    PoolingEngine,
    SchedulerConfig,
    SpeculativeConfigError,
    create_engine,
)
from server.adapters.registry import AdapterRegistry
from server.api import build_app
from server.edge.connections import bounded_http_protocol
from server.edge.metrics import ServerMetrics
from server.reasoning.formats import reasoning_format
from server.startup.config import ServeConfig
from server.startup.embedding import EmbeddingServer, build_embedding_server, embedding_kind
from server.startup.tensor_parallel import TensorParallelGroup, start_rank0
from server.state import ServerState

logger = logging.getLogger("llamaserve.server")


def load(config: ServeConfig, tp: TensorParallel | None = None) -> LoadedModel:
    device = resolve_device(config.device)
    if config.random_weights:
        if config.model_config is None:
            raise UnsupportedModelError("--random-weights needs --model-config (e.g. llama3-1b)")
        return load_random_model(
            config.model_config,
            device=device,
            dtype=config.dtype,
            tokenizer_path=config.tokenizer,
            max_position=config.engine.max_model_len,
            quantization=config.quantization,
            batch_invariant=config.batch_invariant,
            attention_backend=config.attention_backend,
            cpu_kernels=config.cpu_kernels,
            tp=tp,
        )
    return load_model(
        config.model,
        device=device,
        dtype=config.dtype,
        max_position=config.engine.max_model_len,
        quantization=config.quantization,
        batch_invariant=config.batch_invariant,
        attention_backend=config.attention_backend,
        tp=tp,
        cpu_kernels=config.cpu_kernels,
    )


def load_draft(config: ServeConfig, target: LoadedModel) -> LoadedModel | None:
    """The draft model a "draft_model" --speculative-config names, loaded as the target is
    (device, dtype, weight format, positions); it must share the target's vocabulary, or
    its guesses would be other tokens."""
    spec = config.engine.speculative
    if spec is None or spec.model is None:
        return None
    # Under -tp the draft is whole, on rank 0 alone, which runs the engine: it computes no
    # collective, and the ranks verify its guesses in the target's sharded forward.
    try:
        draft = load_model(
            spec.model,
            device=resolve_device(config.device),
            dtype=config.dtype,
            max_position=target.config.max_position,
            quantization=config.quantization,
            batch_invariant=config.batch_invariant,
            attention_backend=config.attention_backend,
            cpu_kernels=config.cpu_kernels,
        )
    except (ModelFileError, UnsupportedModelError, UnsupportedFormatError) as exc:
        raise SpeculativeConfigError(f"--speculative-config: draft model: {exc}") from None
    ours, theirs = target.tokenizer, draft.tokenizer
    if ours.vocab_size != theirs.vocab_size or any(
        ours.token_bytes(i) != theirs.token_bytes(i) for i in range(ours.vocab_size)
    ):
        raise SpeculativeConfigError(
            f"--speculative-config: the draft model {draft.name} has another vocabulary "
            f"({theirs.vocab_size} tokens) than {target.name} ({ours.vocab_size})"
        )
    logger.info("speculative decoding with draft model %s", draft.name)
    return draft


def build_server(
    config: ServeConfig, loaded: LoadedModel | None = None
) -> tuple[FastAPI, ServerState]:
    """With -tp N, this process becomes rank 0: it starts its machine's other ranks first
    (server/startup/tensor_parallel.py), and its model broadcasts every step to them."""
    kind = embedding_kind(config)
    if kind is not None and config.engine.max_loras:
        raise UnsupportedModelError("LoRA adapters serve text generation only; this model embeds")
    if kind is not None:
        decoder = (loaded or load(config)) if kind == "decoder" else None
        embedder = build_embedding_server(config, decoder)
        return _serve(config, embedder.engine, embedder.engine.config, None, embedder)
    parallel = config.parallel.resolved()
    group = None
    if parallel.tensor_parallel_size > 1:
        group = start_rank0(config, parallel)
    try:
        # Servers starting together take turns: each measures on a quiet machine, or reads
        # what the one before it measured (model/plan/tuning.py). Not across the ranks of -tp,
        # which must load together.
        with tuning.startup() if group is None else contextlib.nullcontext():
            if loaded is None:
                tp = TensorParallel(0, parallel.tensor_parallel_size) if group else None
                loaded = load(config, tp)
            if group is not None:
                loaded.model.before_forward = group.sender
            draft = load_draft(config, loaded)
            engine = create_engine(
                loaded.model, loaded.tokenizer, config.engine, draft.model if draft else None
            )
    except BaseException:
        if group is not None:
            group.close(engine_stopped=False)
        raise
    return _serve(config, engine, engine.scheduler.config, group, loaded)


def _serve(
    config: ServeConfig,
    engine: Engine | PoolingEngine,
    limits: SchedulerConfig,
    group: TensorParallelGroup | None,
    model: LoadedModel | EmbeddingServer,
) -> tuple[FastAPI, ServerState]:
    """The app around a built engine, whichever task it serves."""
    names = config.served_model_name or [model.name]
    metrics = ServerMetrics(names[0], limits.max_model_len, limits.max_num_batched_tokens)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
    embedding = isinstance(model, EmbeddingServer)
    state = ServerState(
        engine=async_engine,
        tokenizer=model.tokenizer,
        chat_template=None if embedding else model.chat_template,
        model_name=names[0],
        extra_model_names=names[1:],
        max_model_len=limits.max_model_len,
        vocab_size=model.vocab_size if embedding else model.config.vocab_size,
        embedding=model.spec if embedding else None,
        scores_pairs=isinstance(model, EmbeddingServer) and model.spec is None,
        api_keys=config.api_keys,
        metrics_require_api_key=config.metrics_require_api_key,
        max_request_bytes=config.max_request_bytes,
        reasoning=None
        if embedding
        else reasoning_format(config.reasoning_parser, model.chat_template),
    )
    if limits.max_loras and not embedding:
        state.adapters = adapter_registry(config, model.config, names[0])
    app = build_app(state, metrics, config.allowed_origins, webui=config.webui)
    app.state.tensor_parallel = group
    url = f"http://{config.host}:{config.port}/v1"

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("llamaserve ready: model %s at %s", state.model_name, url)
        yield
        async_engine.shutdown()
        if group is not None:
            group.close(engine_stopped=not async_engine.thread_running)
        logger.info("llamaserve stopped")

    app.router.lifespan_context = lifespan
    return app, state


UNHEALTHY_BEFORE_EXIT_S = 2.0


def watch_ranks(app: FastAPI, server: uvicorn.Server) -> list[str]:
    """Under tensor parallelism: when a worker exits or the engine thread dies of a
    collective that failed, stop the engine (/health answers 503, in-flight requests end
    with an error) and the server. Returns the list the reason is put in."""
    lost: list[str] = []
    group = app.state.tensor_parallel
    if group is None:
        return lost
    engine: AsyncEngine = app.state.llamaserve.engine

    def on_lost(reason: str) -> None:
        if lost or server.should_exit:
            return
        reason = group.exited_worker() or _short(reason)
        lost.append(reason)
        group.lost = True
        logger.error("%s: stopping the server", reason)
        engine.fail(reason)
        # /health answers 503 for a moment first, so probes and routers see it go.
        threading.Timer(
            UNHEALTHY_BEFORE_EXIT_S, lambda: setattr(server, "should_exit", True)
        ).start()

    group.watch(on_lost)
    engine.on_death = on_lost
    return lost


def _short(reason: str) -> str:
    """The first sentence of an error from the collectives' library, without its source
    location: "Read error [127.0.0.1]:24974: Connection reset by peer"."""
    reason = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", reason)
    return reason.split(". ")[0].rstrip(".")


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises the stopping signal once its graceful shutdown is done, so the
    process would end as 'killed by SIGTERM'; an orderly stop should exit 0."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        stopping = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in stopping}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_server(app: FastAPI, config: ServeConfig) -> uvicorn.Server:
    return GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,  # our logging setup; uvicorn's access log is replaced by ours
            access_log=False,
            timeout_graceful_shutdown=int(config.shutdown_grace_s),
            http=bounded_http_protocol(config.header_timeout_s),
            timeout_keep_alive=config.timeout_keep_alive_s,
            limit_concurrency=config.limit_concurrency,
            backlog=config.backlog,
        )
    )


def adapter_registry(config: ServeConfig, base: ModelConfig, base_name: str) -> AdapterRegistry:
    """The adapters' names, with --lora-modules' read and checked: a wrong one stops the
    start-up with its one sentence (a `ModelFileError`)."""
    registry = AdapterRegistry(base, base_name, config.engine.max_lora_rank)
    for name, path in config.lora_modules.items():
        try:
            registry.add(name, path)
        except ValueError as exc:
            raise ModelFileError(f"--lora-modules {name}={path}: {exc}") from None
    return registry
