"""What a model will cost in memory before it loads, what a loaded one costs (the resident
memory of its process, from the kernel) and which idle models must go to make room.

The estimate is the weights as their files hold them, plus the KV cache the engine
allocates whole at start-up (`--kv-cache-memory`, by default 2 GiB on a CPU; none for a
model that embeds), plus what a Python process with torch holds before any model. It is
decided before the process starts, so a model that cannot fit is refused without
disturbing the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from model.checkpoint.pypi_models import PYPI_MODELS
from model.encoder.checkpoint import is_encoder_dir
from scheduler import DEFAULT_CPU_KV_BYTES
from server.startup.memory_size import parse_memory_size

# A `llamaserve serve` process with torch imported and a tiny model loaded holds about
# 290 MB resident on the CPU machines; rounded up, for what a step's buffers add.
PROCESS_BASE_BYTES = 400 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pth", ".pt")


def weight_bytes(source: str) -> int:
    """The bytes of a checkpoint's weight files; a PyPI GGUF's published size."""
    if source in PYPI_MODELS:
        return PYPI_MODELS[source].size
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(
            f.stat().st_size
            for f in path.rglob("*")
            if f.is_file() and f.suffix in _WEIGHT_SUFFIXES
        )
    return 0  # a PyPI directory not fetched yet: its process fetches it and the RSS shows it


def last_flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def estimate_bytes(source: str, argv: Sequence[str]) -> int:
    """What a model's process will hold once loaded; `argv` is its whole command line."""
    path = Path(source)
    embeds = last_flag_value(argv, "--task") == "embed" or (path.is_dir() and is_encoder_dir(path))
    kv_flag = last_flag_value(argv, "--kv-cache-memory")
    kv = 0 if embeds else (parse_memory_size(kv_flag) if kv_flag else DEFAULT_CPU_KV_BYTES)
    return PROCESS_BASE_BYTES + weight_bytes(source) + kv


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def available_bytes() -> int:
    """Memory the kernel could give without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class Resident:
    """A loaded (or loading) model as the room planner sees it."""

    name: str
    bytes: int  # what it is counted as holding: its estimate
    evictable: bool  # loaded with nothing in flight
    last_used: float


class NoRoom(Exception):
    """The model cannot fit even after every idle one is unloaded."""


def plan_room(
    need: int, budget: int, residents: Sequence[Resident], max_models: int | None
) -> list[str]:
    """The least recently used evictable models to unload so that `need` more bytes fit in
    `budget` and at most `max_models` are loaded; raises NoRoom when no choice does."""
    used = sum(r.bytes for r in residents)
    count = len(residents)
    victims: list[str] = []
    for resident in sorted((r for r in residents if r.evictable), key=lambda r: r.last_used):
        fits = used + need <= budget and (max_models is None or count < max_models)
        if fits:
            break
        victims.append(resident.name)
        used -= resident.bytes
        count -= 1
    if need > budget:
        raise NoRoom(
            f"it needs about {need / 2**30:.2f} GiB, more than the whole budget of "
            f"{budget / 2**30:.2f} GiB"
        )
    if used + need > budget:
        raise NoRoom(
            f"it needs about {need / 2**30:.2f} GiB and the models in use hold "
            f"{used / 2**30:.2f} GiB of {budget / 2**30:.2f} GiB"
        )
    if max_models is not None and count >= max_models:
        raise NoRoom(
            f"all {count} loaded models (--models-max {max_models}) have requests in flight"
        )
    return victims
