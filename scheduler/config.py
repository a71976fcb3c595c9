"""`EngineConfig`: every knob of the engine in one dataclass, built from the CLI and
passed down; its defaults are the CLI's defaults, and nothing below reads flags or the
environment."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.spec.speculation import SpeculativeConfig

# Tokens one step may feed on a GPU when --max-num-batched-tokens is not given.
GPU_MAX_NUM_BATCHED_TOKENS = 2048


class EngineConfigError(ValueError):
    """An engine setting this model or device cannot honour; one sentence the CLI prints."""


# The KV cache a CPU server allocates when --kv-cache-memory is not given.
DEFAULT_CPU_KV_BYTES = 2 * 2**30


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64
    # Tokens one step may feed. None: on a CPU, as many as the prefill speed measured at
    # start-up computes in max_step_ms, so a long prompt never stalls running streams for
    # seconds; on a GPU, 2048.
    max_num_batched_tokens: int | None = None
    max_step_ms: float = 200.0
    max_waiting: int = 1024
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a default for the device
    # "auto": K/V in the model's dtype; "int8": int8 with a scale per token and KV head
    # (model/network/kv_int8.py), about twice bf16's tokens in the same memory.
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA: no decode-step graphs
    speculative: SpeculativeConfig | None = None  # --speculative-config
    # LoRA adapters (--enable-lora): how many are resident at once and their largest rank.
    # max_loras 0: no adapters.
    max_loras: int = 0
    max_lora_rank: int = 16


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the server answers 503 rather than queue forever."""


@dataclass
class SchedulerConfig:
    """Built from `EngineConfig` once the runner has capped max_model_len to the cache."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    speculative: SpeculativeConfig | None = None  # n-gram speculation, when configured
    max_loras: int = 0  # adapters among the running requests at once
