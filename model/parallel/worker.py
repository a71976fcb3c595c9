"""A tensor-parallel worker (every rank but 0): loads its shard, then runs whatever forward
rank 0 broadcasts, until told to stop or its peers are gone. It never sees a request.

Started by the server (`llamaserve serve -tp N` spawns the local ranks), or one per process
under torchrun."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from dataclasses import dataclass

import torch

from model.loader import load_model
from model.paged_cache import PagedKVCache
from model.parallel.distributed import DistributedSpec, close_distributed, init_distributed
from model.parallel.plan import TensorParallel
from model.parallel.steps import batch_to, broadcast

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    distributed: DistributedSpec
    model: str | None
    dtype: str
    quantization: str | None
    attention_backend: str
    max_position: int | None
    threads: int
    log_level: str = "INFO"


def worker_main(spec: WorkerSpec) -> None:
    """Process entry point; exits 0 when stopped, 1 when it lost its peers."""
    _die_with_parent()
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{spec.distributed.rank} %(name)s: %(message)s",
    )
    torch.set_num_threads(spec.threads)
    try:
        init_distributed(spec.distributed)
        code = serve_steps(spec)
    except Exception as exc:
        logger.error("tensor-parallel worker stopped: %s", str(exc).strip().splitlines()[0])
        code = 1
    finally:
        close_distributed()
    sys.exit(code)


def serve_steps(spec: WorkerSpec) -> int:
    d = spec.distributed
    loaded = load_model(
        spec.model,
        device=d.device,
        dtype=spec.dtype,
        quantization=spec.quantization,
        max_position=spec.max_position,
        attention_backend=spec.attention_backend,
        progress=False,
        tp=TensorParallel(d.rank, d.world_size),
    )
    model = loaded.model
    dtype = model.embed_tokens.weight.dtype
    serving: PagedKVCache | None = None
    while True:
        message = broadcast(None)
        if message.batch is None:
            logger.info("stopped by rank 0")
            return 0
        if message.serving_cache:
            if serving is None or serving.num_blocks != message.num_blocks:
                serving = PagedKVCache.allocate(
                    model.config, message.num_blocks, message.block_size, dtype, d.device
                )
            cache = serving
        else:
            cache = PagedKVCache.allocate(
                model.config, message.num_blocks, message.block_size, dtype, d.device
            )
        model(batch_to(message.batch, d.device), cache)


def _die_with_parent() -> None:
    """A worker must not outlive the server that started it, even one killed by SIGKILL."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
