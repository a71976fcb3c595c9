"""The configuration `llamaserve serve` builds from its flags and hands down: `ServeConfig`
(what to load, how to serve it, the engine's `EngineConfig`) and `ParallelConfig` (the
tensor-parallel ranks). Plain values: who starts what with them is launch.py's and
tensor_parallel.py's, and both import them from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from scheduler import EngineConfig
from server.startup.flags import UsageError

DEFAULT_MASTER_PORT = 29500


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one machine, 29500 on several
    timeout_s: float = 60.0

    def resolved(self) -> ParallelConfig:
        """Under torchrun its environment names the ranks; flags must agree with it."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            self.check()
            return self
        world = int(os.environ["WORLD_SIZE"])
        if self.tensor_parallel_size not in (1, world):
            raise UsageError(
                f"--tensor-parallel-size {self.tensor_parallel_size} disagrees with "
                f"torchrun's WORLD_SIZE {world}"
            )
        return ParallelConfig(
            tensor_parallel_size=world,
            nnodes=world,  # one rank per process: each "node" is one process
            node_rank=int(os.environ["RANK"]),
            master_addr=os.environ.get("MASTER_ADDR", self.master_addr),
            master_port=int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            timeout_s=self.timeout_s,
        )

    def check(self) -> None:
        n, nodes = self.tensor_parallel_size, self.nnodes
        if n < 1:
            raise UsageError(f"--tensor-parallel-size must be at least 1, got {n}")
        if nodes < 1 or n % nodes:
            raise UsageError(f"--nnodes {nodes} does not divide --tensor-parallel-size {n}")
        if not 0 <= self.node_rank < nodes:
            raise UsageError(f"--node-rank {self.node_rank} is not in 0..{nodes - 1}")
        if nodes > 1 and self.master_port is None:
            self.master_port = DEFAULT_MASTER_PORT

    @property
    def local_ranks(self) -> range:
        per_node = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


@dataclass
class ServeConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    reasoning_parser: str = "auto"  # server/reasoning/formats.py: auto, none, qwen3, ...
    api_keys: list[str] = field(default_factory=list)
    metrics_require_api_key: bool = False
    device: str = "cpu"  # or "cuda", "cuda:N", "auto" (cuda when a GPU is visible)
    attention_backend: str = "auto"  # model/attention: by device
    cpu_kernels: str = "auto"  # model/plan/mode.py: auto, native or torch
    # A dtype, or a name ("auto" times this machine); the CLI defaults to "auto", code that
    # builds a config to the exact float32 the transformers comparisons hold to.
    dtype: torch.dtype | str = torch.float32
    quantization: str | None = None  # "int8", "int4", "w4a8", "auto"; None: in dtype
    batch_invariant: bool = False  # only formats whose greedy output is batch-independent
    task: str = "auto"  # "generate", "embed"; auto: embed for an encoder checkpoint
    pooling: str | None = None  # embed: a mode or vLLM's pooler JSON; None: the model's
    # LoRA adapters served from the start, name -> path (engine.max_loras > 0 serves any).
    lora_modules: dict[str, str] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)
    allowed_origins: list[str] = field(default_factory=list)
    webui: bool = True  # the chat page at `/` (server/webui/); --no-webui turns it off
    max_request_bytes: int = 8 * 2**20
    shutdown_grace_s: float = 10.0
    # What one connection may cost (server/edge/connections.py): an idle keep-alive connection
    # is closed after timeout_keep_alive_s, one that has not sent a whole request head
    # after header_timeout_s; beyond limit_concurrency open connections or requests in
    # flight new requests get 503; backlog is the kernel's queue of unaccepted ones.
    timeout_keep_alive_s: int = 5
    header_timeout_s: float = 10.0
    limit_concurrency: int | None = 2048
    backlog: int = 2048
    random_weights: bool = False  # with model_config: a preset's shapes, random weights
    model_config: str | None = None
    tokenizer: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # -tp and its peers
