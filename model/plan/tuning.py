"""Start-up measurements that hold: the timings behind the choices a CPU server makes as
it starts (weight format, int4 kernel per layer shape, output projection, threads for
one-token steps, the step's token budget) are taken once per CPU, kernel build, model
shape and thread count, stored beside the kernel library, and reused at the next start;
so is one accuracy figure, the activation probe's (model/plan/activation_probe.py).

Measured afresh at every start, those choices depended on what else ran in those
seconds: a server started during a build picked one thread for one-token steps and half
its token budget, and two replicas started together measured each other. So:

- a server's whole start-up (loading and measuring, `startup()`) runs under a lock file:
  a second server starting at the same moment waits for it, then reads what the first
  measured, so it chooses what one alone would and never measures while the other loads;
- the CPU time other processes use during a measurement is read from /proc/stat: above a
  quarter of the machine, the measurement is taken again (three tries, half a second and
  then a second apart), and a result that only a busy machine gave is used for this run
  but never stored;
- `llamaserve tune` (or `LLAMASERVE_RETUNE=1`) measures again and overwrites.

`LLAMASERVE_TUNING_STORE` names another directory for the store, or `off` for none (the
test suite's setting: tests that time things must see them timed). Where the store cannot
be written, every start measures, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from model.native.build import NativeUnavailable, cache_dir, cpu_id, isa, library_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETUNE_ENV = "LLAMASERVE_RETUNE"
STORE_ENV = "LLAMASERVE_TUNING_STORE"
BUSY_FRACTION = 0.25  # of the machine's CPU time, used by other processes
BUSY_FLOOR_S = 0.05  # below this, /proc/stat's 10 ms ticks cannot tell
ATTEMPTS = 3
RETRY_WAIT_S = 0.5

_lock = threading.RLock()
_retune = False
_announced: set[Path] = set()
# Per loaded model, what was measured on it in this process (remembered_for).
_on_model: weakref.WeakKeyDictionary[object, dict[str, object]] = weakref.WeakKeyDictionary()


def retune(enabled: bool = True) -> None:
    """Measure again (and overwrite what is stored) for the rest of this process."""
    global _retune
    _retune = enabled


def config_key(config: object) -> dict[str, object]:
    """A model's shape as a key: its config dataclass's fields."""
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {"config": config}


def store_path() -> Path | None:
    """The file for this CPU, kernel build level and kernel sources (as the library's own
    name is keyed), and this PyTorch; None when the store is off."""
    where = os.environ.get(STORE_ENV)
    if where == "off":
        return None
    level = _level()
    try:
        key = library_key(level)
    except NativeUnavailable:
        key = hashlib.sha256(cpu_id()).hexdigest()  # no C kernels: PyTorch's alone
    tag = hashlib.sha256(f"{key} {torch.__version__}".encode()).hexdigest()[:16]
    return Path(where or cache_dir()) / f"tuning-{level}-{tag}.json"


def _entry(kind: str, key: Mapping[str, object]) -> str:
    """What a measurement is stored under: its kind, the thread count and its key."""
    return json.dumps(
        {"kind": kind, "threads": torch.get_num_threads(), **key}, sort_keys=True, default=str
    )


def remembered_for(
    owner: object,
    kind: str,
    key: Mapping[str, object],
    measure: Callable[[], T],
    decode: Callable[[object], T] = lambda value: value,  # type: ignore[assignment,return-value]
) -> T:
    """As `remembered`, and kept with `owner` (a loaded model) for the rest of the process,
    store or no store: a process that starts several engines on one model (a benchmark, the
    tests) times it once; the key still says what the timing depends on."""
    entry = _entry(kind, key)
    known = _on_model.setdefault(owner, {})
    if entry not in known:
        known[entry] = remembered(kind, key, measure, decode)
    return known[entry]  # type: ignore[return-value]


def remembered(
    kind: str,
    key: Mapping[str, object],
    measure: Callable[[], T],
    decode: Callable[[object], T] = lambda value: value,  # type: ignore[assignment,return-value]
    timed: bool = True,
) -> T:
    """`measure()`'s result, stored under (kind, key, the thread count), or read back from
    an earlier start. `decode` turns its JSON form back into what `measure` returns.
    `timed=False`: a result other processes cannot change (an accuracy figure), stored
    however busy the machine was."""
    entry = _entry(kind, key)
    path = store_path()
    if path is None:
        return measure()
    with _locked(path) as writable:
        if writable and not (_retune or os.environ.get(RETUNE_ENV) == "1"):
            stored = _read(path).get(entry)
            if stored is not None:
                if path not in _announced:
                    _announced.add(path)
                    logger.info(
                        "start-up measurements read from %s (`llamaserve tune` measures again)",
                        path,
                    )
                return decode(stored)
        for attempt in range(1, ATTEMPTS + 1):
            with _other_processes() as others:
                value = measure()
            if not (timed and others.busy):
                if writable:
                    _write(path, entry, value)
                return value
            logger.warning(
                "%s: other processes used %.0f%% of the CPUs while it was measured; %s",
                kind,
                100 * others.fraction,
                "measuring again" if attempt < ATTEMPTS else "using it for this run, not stored",
            )
            if attempt < ATTEMPTS:
                time.sleep(RETRY_WAIT_S * attempt)  # a neighbour's start-up may pass
        return value


@contextlib.contextmanager
def startup() -> Iterator[None]:
    """The store held for a whole start-up: measurements inside it take the lock once."""
    path = store_path()
    if path is None:
        yield
        return
    with _locked(path):
        yield


@dataclasses.dataclass
class _Others:
    fraction: float = 0.0
    seconds: float = 0.0

    @property
    def busy(self) -> bool:
        return self.seconds > BUSY_FLOOR_S and self.fraction > BUSY_FRACTION


@contextlib.contextmanager
def _other_processes() -> Iterator[_Others]:
    """The CPU time every process but this one used during the block, as a fraction of
    what the machine's CPUs had."""
    others = _Others()
    machine, own, wall = _machine_cpu_s(), _own_cpu_s(), time.perf_counter()
    yield others
    if machine is None:
        return
    elapsed = time.perf_counter() - wall
    used = (_machine_cpu_s() or machine) - machine - (_own_cpu_s() - own)
    others.seconds = max(used, 0.0)
    others.fraction = others.seconds / max(elapsed * (os.cpu_count() or 1), 1e-9)


def _machine_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot, from /proc/stat's first line."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


_held: bool | None = None  # inside a measurement: whether the lock file is held


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """The store's lock file held, once per process (measurements nest: a weight format's
    timing builds int4 layers that time their kernels); yields whether the store can be
    used at all."""
    global _held
    with _lock:
        if _held is not None:
            yield _held
            return
        handle = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:
            logger.warning("start-up measurements are not stored: %s", exc)
            if handle is not None:
                handle.close()
            handle = None
        _held = handle is not None
        try:
            yield _held
        finally:
            _held = None
            if handle is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, entry: str, value: object) -> None:
    data = _read(path)
    data[entry] = value
    partial = path.with_suffix(f".{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as exc:
        logger.warning("start-up measurements are not stored: %s", exc)


def _level() -> str:
    try:
        return isa()
    except NativeUnavailable:
        return "none"
