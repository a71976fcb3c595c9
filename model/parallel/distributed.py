"""Joining the ranks: one process group over TCP (gloo on CPU, NCCL on CUDA), with a
timeout that bounds both the wait for peers at start-up and every collective after it, so
a missing or hung rank becomes an error rather than a hang."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class DistributedError(RuntimeError):
    """The ranks could not meet or lost each other; the message is one sentence."""


@dataclass(frozen=True)
class DistributedSpec:
    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    device: str = "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if torch.device(self.device).type == "cuda" else "gloo"


def init_distributed(spec: DistributedSpec) -> None:
    if torch.device(spec.device).type == "cuda":
        torch.cuda.set_device(torch.device(spec.device))
    try:
        dist.init_process_group(
            spec.backend,
            init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
    except Exception as exc:  # the store's timeout, a refused connection, a bad address
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"rank {spec.rank} of {spec.world_size} could not meet its peers at "
            f"{spec.master_addr}:{spec.master_port} within {spec.timeout_s:.0f} s ({first_line})"
        ) from None
    logger.info(
        "rank %d of %d joined %s at %s:%d",
        spec.rank,
        spec.world_size,
        spec.backend,
        spec.master_addr,
        spec.master_port,
    )


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
