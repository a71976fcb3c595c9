"""Timing of a short run, for the start-up choices that are made by measuring on the
machine (weight format, int4 kernel) rather than assumed."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch


def best_ms(
    run: Callable[[], object], reps: int = 3, clock: Callable[[], int] = time.perf_counter_ns
) -> float:
    """The best of a few timed runs after a warm-up (first calls pick kernels and fault
    pages in); the best, because another process can only make a run slower."""
    run()
    times = []
    for _ in range(reps):
        started = clock()
        run()
        times.append(clock() - started)
    return min(times) / 1e6


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size, from sysfs; 64 MiB where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=64 << 20)


def cold_best_ms(run: Callable[[], object], reps: int = 3) -> float:
    """As `best_ms`, each timed run after twice the last-level cache is written over: for a
    weight that a decode step streams from memory (the step reads far more than the cache
    holds), where a warm repeat would read a small one from the cache instead."""
    flush = torch.empty(2 * last_level_cache_bytes(), dtype=torch.uint8)
    run()
    times = []
    for _ in range(reps):
        flush.fill_(len(times))
        started = time.perf_counter_ns()
        run()
        times.append(time.perf_counter_ns() - started)
    return min(times) / 1e6


def best_thread_ms(run: Callable[[], object], reps: int = 5) -> float:
    """As `best_ms`, in the calling thread's CPU time: for a run that computes on this
    thread alone (`on_one_thread`), what it cost whatever else the machine runs (another
    process can take the core between two instructions and it does not count)."""
    return best_ms(run, reps, clock=time.thread_time_ns)


@contextlib.contextmanager
def on_one_thread() -> Iterator[None]:
    """Runs the block with PyTorch's and the C kernels' OpenMP teams at one thread. For
    comparing two C kernels that share their tiling and its split among threads (int6 and
    grouped int8): their ratio on one thread holds on two, and a one-thread run does not
    wait for a second core that another process holds (on a busy 2-core machine two-thread
    runs came out at 4, 8 or 12 ms, the scheduler's time slices, whatever the kernel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread_geometric_ms(
    products: Sequence[Callable[[torch.Tensor], object]], in_features: int, batches: Sequence[int]
) -> tuple[float, ...]:
    """Each product's milliseconds a call on random bf16 rows, on one thread in its CPU time
    (`on_one_thread`, `best_thread_ms`), as the geometric mean over `batches` rows: for C
    kernels that share their tiling, one of which a layer keeps at every batch size."""
    logs = [0.0] * len(products)
    with on_one_thread():
        for batch in batches:
            x = torch.randn(batch, in_features).bfloat16()
            for i, product in enumerate(products):
                logs[i] += math.log(best_thread_ms(partial(product, x)))
    return tuple(math.exp(total / len(batches)) for total in logs)
