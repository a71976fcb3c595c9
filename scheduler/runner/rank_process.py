"""The process of a tensor-parallel rank other than 0: loads its shard, then runs whatever
forward rank 0 broadcasts, until told to stop or its peers are gone. It never sees a
request. A process main loop, so it lives on the runner's side; the model keeps the
sharded layers and the communication calls (model/parallel/).

Started by the server (`llamaserve serve -tp N` spawns the local ranks), or one per process
under torchrun."""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
from dataclasses import asdict, dataclass

import torch

from model.loader import load_model
from model.network.paged_cache import PagedKVCache
from model.parallel.distributed import DistributedSpec, close_distributed, init_distributed
from model.parallel.plan import TensorParallel
from model.parallel.steps import batch_to, broadcast
from model.random_model import load_random_model

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
    random_preset: str | None = None  # --random-weights --model-config PRESET

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        return cls(**{**fields, "distributed": DistributedSpec(**fields["distributed"])})


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
    tp = TensorParallel(d.rank, d.world_size)
    if spec.random_preset is not None:
        loaded = load_random_model(
            spec.random_preset,
            device=d.device,
            dtype=spec.dtype,
            max_position=spec.max_position,
            quantization=spec.quantization,
            attention_backend=spec.attention_backend,
            tp=tp,
        )
    else:
        loaded = load_model(
            spec.model,
            device=d.device,
            dtype=spec.dtype,
            quantization=spec.quantization,
            max_position=spec.max_position,
            attention_backend=spec.attention_backend,
            progress=False,
            tp=tp,
        )
    model = loaded.model
    dtype = model.dtype
    cache: PagedKVCache | None = None
    while True:
        message = broadcast(None)
        if message.batch is None:
            logger.info("stopped by rank 0")
            return 0
        if (
            cache is None
            or cache.num_blocks != message.num_blocks
            or cache.quantized != message.int8
        ):
            cache = None  # freed before its successor is allocated
            cache = PagedKVCache.allocate(
                model.config,
                message.num_blocks,
                message.block_size,
                torch.int8 if message.int8 else dtype,
                d.device,
            )
        model(batch_to(message.batch, d.device), cache)


def main() -> None:
    """`python -m scheduler.runner.rank_process SPEC_JSON`, as the server starts its local ranks."""
    worker_main(WorkerSpec.from_json(sys.argv[1]))


def _die_with_parent() -> None:
    """A worker must not outlive the server that started it, even one killed by SIGKILL."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


if __name__ == "__main__":
    main()
