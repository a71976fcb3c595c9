"""Timing of a short run, for the start-up choices that are made by measuring on the
machine (weight format, int4 kernel) rather than assumed."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_ms(run: Callable[[], object], reps: int = 3) -> float:
    """The best of a few timed runs after a warm-up (first calls pick kernels and fault
    pages in); the best, because another process can only make a run slower."""
    run()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3
