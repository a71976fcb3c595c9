"""Releasing a thread's OpenMP workers, so that the engine thread's team is the only one.

libgomp (the OpenMP runtime of PyTorch's CPU wheels) keeps each thread's team of workers
alive once that thread has run a parallel region, and as soon as it manages more threads
than there are CPUs it cuts its spin-wait to almost nothing: every parallel region then
wakes its workers through the kernel. The thread that loads the model keeps such a team,
so on a 2-core machine the engine thread's two-thread steps paid that wake-up on every
matrix product: a one-token step took 50-55 ms on two threads against 23-26 ms once the
loading thread's team was released (and 28-34 ms on one thread).

OpenMP 5's `omp_pause_resource_all` frees the calling thread's team. It is looked up in
the runtime this process has already loaded, never loaded anew; where there is none (or
another runtime without it), releasing does nothing.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


def loaded_openmp_runtime() -> str | None:
    """The path of the libgomp mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and Path(fields[5].strip()).name.startswith("libgomp"):
                    return fields[5].strip()
    except OSError:
        return None
    return None


def release_openmp_workers() -> bool:
    """Frees the calling thread's OpenMP workers; True if the runtime did. The next
    parallel region this thread runs starts a new team, so calling it costs at most one
    thread start-up later."""
    path = loaded_openmp_runtime()
    if path is None:
        return False
    pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    released = pause(OMP_PAUSE_SOFT) == 0
    logger.debug("OpenMP workers of this thread released: %s", released)
    return released
