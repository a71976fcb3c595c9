"""Starting and watching the ranks of a tensor-parallel server (`-tp N`).

Rank 0 is this process: it serves HTTP, schedules and samples. The other ranks of this
machine are child processes (`scheduler/runner/rank_process.py`); with `--nnodes`, machine
k runs ranks [k * N / nnodes, (k + 1) * N / nnodes) and only rank 0's machine serves. Under
torchrun (RANK and WORLD_SIZE in the environment) every rank is its own process already.

A watchdog turns a lost worker into a stopped engine (/health 503, every in-flight
request ends with an error) and a server that exits with one line; a missing peer at
start-up or a collective that outlives --distributed-timeout is an error, never a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

import torch

from model.loader import checkpoint_config, resolve_device
from model.parallel.distributed import DistributedSpec, close_distributed, init_distributed
from model.parallel.plan import TensorParallel
from model.parallel.steps import StepSender
from model.presets import preset_config
from scheduler import WorkerSpec, serve_steps
from server.startup.config import DEFAULT_MASTER_PORT, ParallelConfig, ServeConfig

logger = logging.getLogger("llamaserve.server")


def rank_device(device: str, rank: int, per_node: int) -> str:
    """On CUDA each rank of a machine takes its own GPU; on the CPU all share it."""
    if torch.device(device).type == "cuda":
        return f"cuda:{rank % per_node}"
    return device


class TensorParallelGroup:
    """Rank 0's side: the step sender its model calls, and the local worker processes."""

    def __init__(self, workers: dict[int, subprocess.Popen]) -> None:
        self.workers = workers
        self.sender = StepSender()
        self._closing = False
        self.lost = False  # a rank failed: no stop message, the workers are killed

    def watch(self, on_lost: Callable[[str], None], interval_s: float = 0.2) -> None:
        def poll() -> None:
            while not self._closing:
                for rank, process in self.workers.items():
                    if process.poll() is not None and not self._closing:
                        on_lost(_exited(rank, process.returncode))
                        return
                time.sleep(interval_s)

        threading.Thread(target=poll, name="llamaserve-tp-watchdog", daemon=True).start()

    def exited_worker(self, wait_s: float = 0.5) -> str | None:
        """Names a worker that exited, waiting a moment for one: a lost peer reaches rank 0
        as a failed collective a little before its exit status does."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in self.workers.items():
                if process.poll() is not None:
                    return _exited(rank, process.returncode)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, engine_stopped: bool = True) -> None:
        """Stops the workers: a stop message when they can still hear it, then signals."""
        self._closing = True
        stopped = False
        alive = all(p.poll() is None for p in self.workers.values())
        if engine_stopped and alive and not self.lost:
            try:
                self.sender.stop()
                stopped = True
            except Exception:  # a peer already gone: the signals below do the rest
                pass
        if not stopped:
            for process in self.workers.values():
                if process.poll() is None:
                    # A hung worker may not heed SIGTERM: after a lost rank, no grace.
                    process.kill() if self.lost else process.terminate()
        _reap(self.workers.values())
        close_distributed()


def _worker_spec(config: ServeConfig, parallel: ParallelConfig, rank: int) -> WorkerSpec:
    per_node = parallel.tensor_parallel_size // parallel.nnodes
    dtype = config.dtype if isinstance(config.dtype, str) else str(config.dtype).split(".")[-1]
    return WorkerSpec(
        distributed=DistributedSpec(
            rank=rank,
            world_size=parallel.tensor_parallel_size,
            master_addr=parallel.master_addr,
            master_port=parallel.master_port or DEFAULT_MASTER_PORT,
            timeout_s=parallel.timeout_s,
            device=rank_device(resolve_device(config.device), rank, per_node),
        ),
        model=config.model,
        dtype=dtype,
        quantization=config.quantization,
        attention_backend=config.attention_backend,
        max_position=config.engine.max_model_len,
        threads=torch.get_num_threads(),
        log_level=logging.getLevelName(logging.getLogger().level),
        random_preset=config.model_config if config.random_weights else None,
    )


def _spawn(specs: list[WorkerSpec]) -> dict[int, subprocess.Popen]:
    """Each rank a process of its own, which dies with this one
    (scheduler/runner/rank_process.py)."""
    return {
        spec.distributed.rank: subprocess.Popen(
            [sys.executable, "-m", "scheduler.runner.rank_process", spec.to_json()]
        )
        for spec in specs
    }


def check_shapes(config: ServeConfig, size: int) -> None:
    """Refuses a size the model's heads cannot split before any process starts."""
    shapes = (
        preset_config(config.model_config)
        if config.random_weights and config.model_config
        else checkpoint_config(config.model)
    )
    if shapes is not None:
        TensorParallel(0, size).check(shapes)


def start_rank0(config: ServeConfig, parallel: ParallelConfig) -> TensorParallelGroup:
    """Spawns this machine's other ranks and joins the group as rank 0."""
    check_shapes(config, parallel.tensor_parallel_size)
    if parallel.master_port is None:
        parallel.master_port = _free_port()
    in_torchrun = "RANK" in os.environ
    others = [] if in_torchrun else [r for r in parallel.local_ranks if r != 0]
    workers = _spawn([_worker_spec(config, parallel, r) for r in others])
    group = TensorParallelGroup(workers)
    try:
        init_distributed(_worker_spec(config, parallel, 0).distributed)
    except Exception:
        group.close(engine_stopped=False)
        raise
    return group


def run_worker_node(config: ServeConfig, parallel: ParallelConfig) -> int:
    """A machine (or torchrun process) without rank 0: runs its ranks until they stop."""
    check_shapes(config, parallel.tensor_parallel_size)
    if "RANK" in os.environ:
        spec = _worker_spec(config, parallel, parallel.node_rank)
        init_distributed(spec.distributed)
        try:
            return serve_steps(spec)
        finally:
            close_distributed()
    workers = _spawn([_worker_spec(config, parallel, r) for r in parallel.local_ranks])
    logger.info("node %d runs ranks %s", parallel.node_rank, list(parallel.local_ranks))
    try:
        while all(p.poll() is None for p in workers.values()):
            time.sleep(0.2)
    finally:
        _reap(workers.values())
    return 0 if all(p.returncode == 0 for p in workers.values()) else 1


def _reap(processes: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Waits for the processes to end by themselves, then kills what is left."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _exited(rank: int, code: int) -> str:
    return f"tensor-parallel worker rank {rank} exited (exit code {code})"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
