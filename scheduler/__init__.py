"""The scheduler's public face: everything server/ uses of this layer, by name, so the
server depends on what the scheduler offers, not on how its rooms are laid out.

The rooms behind it:
- `sampling_params.py`, `request.py`: the values a request crosses the boundary with;
- `scheduler.py`, `kv_cache.py`, `step_data.py`: who runs each step, the KV blocks, and the
  plain values one step passes to the model runner and back;
- `engine/`: the engine, its asyncio bridge, the embedding engine, detokenised output and
  `create_engine`;
- `spec/`: speculative decoding; `structured/`: grammars and their bitmasks;
- `runner/`: the model runners, the only code here that touches tensors.

Modules inside scheduler/ never import this one (each imports the module it needs): this
module imports them all, and one import back would close a circle through every one.
The names that need torch (the runners, `create_engine`) load on first use, so importing
the scheduler's torch-free parts stays torch-free (tests/test_scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.config import (
    DEFAULT_CPU_KV_BYTES,
    EngineConfig,
    EngineConfigError,
    QueueFull,
    SchedulerConfig,
)
from scheduler.engine.async_engine import AsyncEngine, EngineDead, RequestStream
from scheduler.engine.engine import Engine
from scheduler.engine.pooling_engine import PoolingEngine, PoolingParams
from scheduler.lora_request import LoraRequest
from scheduler.request import RequestOutput, TokenLogprob
from scheduler.sampling_params import (
    ROW_FIELDS,
    InvalidParams,
    SamplingParams,
)
from scheduler.spec.speculation import SpeculativeConfig, SpeculativeConfigError
from scheduler.stats import FinishedStats, StepStats
from scheduler.structured.grammar import Grammar

if TYPE_CHECKING:
    from scheduler.engine.factory import create_engine
    from scheduler.runner.pooling_runner import (
        CrossEncoderRunner,
        DecoderPoolingRunner,
        EncoderRunner,
    )
    from scheduler.runner.rank_process import WorkerSpec, serve_steps

__all__ = [
    "DEFAULT_CPU_KV_BYTES",
    "ROW_FIELDS",
    "AsyncEngine",
    "CrossEncoderRunner",
    "DecoderPoolingRunner",
    "EncoderRunner",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineDead",
    "FinishedStats",
    "Grammar",
    "InvalidParams",
    "LoraRequest",
    "PoolingEngine",
    "PoolingParams",
    "QueueFull",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "StepStats",
    "TokenLogprob",
    "WorkerSpec",
    "create_engine",
    "serve_steps",
]


def __getattr__(name: str) -> object:
    """The names that need torch, imported when first asked for."""
    if name == "create_engine":
        from scheduler.engine.factory import create_engine

        return create_engine
    if name in ("CrossEncoderRunner", "DecoderPoolingRunner", "EncoderRunner"):
        from scheduler.runner import pooling_runner

        return getattr(pooling_runner, name)
    if name in ("WorkerSpec", "serve_steps"):
        from scheduler.runner import rank_process

        return getattr(rank_process, name)
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
