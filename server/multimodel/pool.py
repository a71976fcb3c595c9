"""Which models are loaded, and the only code that loads and unloads them: a model loads
on its first request (or at start), concurrent first requests wait on one load, the least
recently used model with nothing in flight makes room (`--models-max`, the memory
budget), an idle one unloads after `--idle-unload-s`, and a process that dies marks only
its model failed.

Every decision runs on the event loop; one lock orders loads and evictions so the memory
they count is never promised twice. A request for a loaded model takes no lock at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.multimodel.catalog import ModelSpec
from server.multimodel.child import ChildFailed, ModelProcess
from server.multimodel.memory import NoRoom, Resident, estimate_bytes, plan_room

logger = logging.getLogger("llamaserve.models")

IDLE_STOP_GRACE_S = 2.0


class ModelUnavailable(Exception):
    """A request's model cannot serve it now; `retry_after_s` when waiting may help."""

    def __init__(self, message: str, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class PoolSettings:
    shared_flags: tuple[str, ...] = ()  # every model's, before its own
    max_models: int | None = None
    memory_budget_bytes: int = 0
    idle_unload_s: float | None = None
    load_timeout_s: float = 600.0
    stop_grace_s: float = 10.0


@dataclass
class ModelEntry:
    spec: ModelSpec
    argv: tuple[str, ...]  # `serve MODEL ...` for its process
    estimate_bytes: int
    status: str = "unloaded"  # loaded, loading, unloading, unloaded, failed
    reason: str | None = None  # why it failed
    process: ModelProcess | None = None
    loading: asyncio.Future[ModelProcess] | None = None
    in_flight: int = 0
    last_used: float = 0.0
    loads: int = 0
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class ModelPool:
    def __init__(self, specs: Sequence[ModelSpec], settings: PoolSettings) -> None:
        self.settings = settings
        self.entries: dict[str, ModelEntry] = {}
        for spec in specs:
            argv = ("serve", spec.source, *settings.shared_flags, *spec.flags)
            argv += ("--served-model-name", spec.name)
            self.entries[spec.name] = ModelEntry(spec, argv, estimate_bytes(spec.source, argv))
        self._admission = asyncio.Lock()
        self._idle_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for entry in self.entries.values():
            if entry.spec.load_at_start:
                try:
                    await self.acquire(entry.spec.name, count=False)
                except ModelUnavailable as exc:
                    logger.error("model %s: not loaded at start: %s", entry.spec.name, exc)
        if self.settings.idle_unload_s is not None:
            self._idle_task = asyncio.create_task(self._unload_idle())

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        await asyncio.gather(*(self._stop(e, "shutdown") for e in self.entries.values()))

    async def acquire(self, name: str, count: bool = True) -> ModelProcess:
        """The model's running process, loading it first if need be; counts a request in
        flight (`release` ends it) unless `count` is false."""
        entry = self.entries[name]
        while True:
            process = entry.process
            if entry.status == "loaded" and process is not None:
                if count:
                    entry.in_flight += 1
                entry.last_used = time.monotonic()
                return process
            if entry.loading is None:
                async with self._admission:
                    if entry.loading is None and entry.status != "loaded":
                        await self._begin_load(entry)
            if entry.loading is not None:
                try:
                    await asyncio.shield(entry.loading)
                except ChildFailed as exc:
                    raise ModelUnavailable(
                        f"the model `{name}` failed to load: {exc}", "model_load_failed"
                    ) from None

    def release(self, name: str) -> None:
        entry = self.entries[name]
        entry.in_flight -= 1
        entry.last_used = time.monotonic()

    async def _begin_load(self, entry: ModelEntry) -> None:
        """Under the admission lock: make room, then start the load in the background so
        that its waiters, not the lock, wait for it."""
        residents = [
            Resident(
                e.spec.name, e.estimate_bytes, e.status == "loaded" and not e.in_flight, e.last_used
            )
            for e in self.entries.values()
            if e.status in ("loaded", "loading")
        ]
        try:
            victims = plan_room(
                entry.estimate_bytes,
                self.settings.memory_budget_bytes,
                residents,
                self.settings.max_models,
            )
        except NoRoom as exc:
            raise ModelUnavailable(
                f"the model `{entry.spec.name}` cannot be loaded now: {exc}",
                "model_memory_exhausted",
                retry_after_s=5,
            ) from None
        for victim in victims:
            await self._stop(self.entries[victim], "evicted to make room")
        entry.status, entry.reason = "loading", None
        entry.loading = asyncio.get_running_loop().create_future()
        entry.loading.add_done_callback(lambda f: f.exception())  # a failure nobody awaited
        asyncio.create_task(self._load(entry, entry.loading))

    async def _load(self, entry: ModelEntry, done: asyncio.Future[ModelProcess]) -> None:
        name = entry.spec.name
        process = ModelProcess(name, entry.argv)
        started = time.monotonic()
        logger.info("model %s: loading (about %.0f MiB)", name, entry.estimate_bytes / 2**20)
        try:
            await process.start(self.settings.load_timeout_s)
        except (ChildFailed, OSError) as exc:
            entry.status, entry.reason, entry.loading = "failed", str(exc), None
            logger.error("model %s: failed to load: %s", name, exc)
            done.set_exception(ChildFailed(str(exc)))
            return
        entry.process, entry.status, entry.loading = process, "loaded", None
        entry.loads += 1
        entry.last_used = time.monotonic()
        entry.watcher = asyncio.create_task(self._watch(entry, process))
        logger.info("model %s: loaded in %.1f s", name, time.monotonic() - started)
        done.set_result(process)

    async def _watch(self, entry: ModelEntry, process: ModelProcess) -> None:
        """A process that ends without being asked to fails its model until the next load."""
        reason = await process.exit_reason()
        if process.stopping or entry.process is not process:
            return
        entry.process, entry.status, entry.reason = None, "failed", reason
        logger.error("model %s: %s", entry.spec.name, reason)

    async def unload(self, name: str) -> bool:
        """False when the model was not loaded."""
        async with self._admission:
            entry = self.entries[name]
            if entry.process is None:
                return False
            await self._stop(entry, "unloaded on request")
            return True

    async def _stop(self, entry: ModelEntry, why: str) -> None:
        process = entry.process
        if process is None:
            return
        entry.status = "unloading"
        entry.process = None
        # With nothing in flight there is nothing to drain: a process slow to tear down
        # is killed rather than let hold up the load that waits for its memory.
        await process.stop(self.settings.stop_grace_s if entry.in_flight else IDLE_STOP_GRACE_S)
        entry.status = "unloaded"
        logger.info("model %s: %s", entry.spec.name, why)

    async def _unload_idle(self) -> None:
        idle_s = self.settings.idle_unload_s or 0.0
        while True:
            await asyncio.sleep(min(max(idle_s / 4, 0.05), 5.0))
            now = time.monotonic()
            for entry in self.entries.values():
                idle = entry.status == "loaded" and not entry.in_flight
                if idle and now - entry.last_used >= idle_s:
                    async with self._admission:
                        if entry.status == "loaded" and not entry.in_flight:
                            await self._stop(entry, f"unloaded after {idle_s:g} s idle")
