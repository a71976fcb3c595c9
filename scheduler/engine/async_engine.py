"""`AsyncEngine`: runs `Engine.step()` on one background thread and hands each request's
outputs to its own asyncio queue.

The engine thread is the only one that touches the engine. Requests and aborts from the
event loop go through a locked inbox that the thread drains before each step; outputs
come back with `call_soon_threadsafe`. The thread sleeps while there is no work.

It must never call the engine from the event loop, nor block the loop on the engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable

from scheduler.engine.engine import Engine
from scheduler.engine.pooling_engine import PoolingEngine, PoolingParams
from scheduler.lora_request import LoraRequest
from scheduler.request import RequestOutput
from scheduler.runner.openmp import release_openmp_workers
from scheduler.sampling_params import SamplingParams
from scheduler.stats import StepStats

logger = logging.getLogger(__name__)

# How long a thread waiting for the GIL lets its holder run before asking for it (Python's
# default is 5 ms). The engine thread and the event loop hand the GIL back and forth
# around every op and every streamed token; at the default, one stream on a 2-core CPU
# lost about a fifth of its speed (31.7-33.5 against 39.6-40.2 tok/s at 0.5 ms, scenario a
# of bench/serve_bench.py; 32 streams 129.8 against 135.9).
GIL_SWITCH_INTERVAL_S = 0.0005


Params = SamplingParams | PoolingParams  # generation, embedding


class EngineDead(RuntimeError):
    pass


def freeze_startup_objects() -> None:
    """Start-up leaves about 300,000 objects the garbage collector tracks (tokenizer
    tables, imported modules, the model's), all alive until the process ends. Every
    collection of the oldest generation walked them all: 150 ms on the default model, a
    stall of whichever engine step it fell in, and 2-3% of a long prefill's time. Frozen,
    collections walk only what serving allocates; `gc.unfreeze` at shutdown hands them
    back."""
    gc.collect()
    gc.freeze()


class AsyncEngine:
    def __init__(
        self, engine: Engine | PoolingEngine, on_step: Callable[[StepStats], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, list[int], Params, LoraRequest | None, asyncio.Future]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llamaserve-engine", daemon=True)
        self.alive = False
        # Told why when the engine thread dies of an exception (tensor parallelism stops
        # the server then: its ranks are out of step).
        self.on_death: Callable[[str], None] | None = None

    def start(self) -> None:
        # The starting thread loaded the model; its OpenMP team would make the engine
        # thread's own one wake through the kernel (scheduler/runner/openmp.py).
        release_openmp_workers()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        freeze_startup_objects()
        self.alive = True
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        gc.unfreeze()

    @property
    def thread_running(self) -> bool:
        return self._thread.is_alive()

    def fail(self, reason: str) -> None:
        """Stops serving from outside the engine thread, which may be stuck: new requests
        are refused and every one in flight ends with `reason` as its error."""
        self.alive = False
        self._stopping = True
        self._wake.set()
        self._fail_all(reason)

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    async def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Params,
        lora: LoraRequest | None = None,
    ) -> RequestStream:
        """Queues a request and waits until the engine admitted it; raises the engine's
        refusal (InvalidParams, QueueFull) so a server can answer before streaming."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        admitted: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._queues[request_id] = (loop, queue)
            self._inbox.append((request_id, prompt_ids, params, lora, admitted))
        self._wake.set()
        try:
            await admitted
        except BaseException:
            self._release(request_id)
            self.abort(request_id)  # cancelled while queued: the engine may have it
            raise
        return RequestStream(self, request_id, params.n, queue)

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)
        for request_id, prompt_ids, params, lora, admitted in inbox:
            loop = admitted.get_loop()
            try:
                if lora is None:  # a pooling engine takes no adapter
                    self.engine.add_request(request_id, prompt_ids, params)
                else:
                    self.engine.add_request(request_id, prompt_ids, params, lora)
            except Exception as exc:  # admission errors go back to the caller
                loop.call_soon_threadsafe(_resolve, admitted, exc)
            else:
                loop.call_soon_threadsafe(_resolve, admitted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._queues.get(o.request_id), o) for o in outputs]
        for target, out in targets:
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)

    def _run(self) -> None:
        # False at start, so the first report (the cache size, empty gauges) comes at once.
        idle_reported = False
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_work():
                    # Gauges are read at the end of a step; an abort or the last finish
                    # leaves no step to say the engine is now idle, so say it once here.
                    if not idle_reported:
                        self._report(self.engine.idle_stats())
                        idle_reported = True
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                idle_reported = False
                outputs, stats = self.engine.step()
                self._deliver(outputs)
                self._report(stats)
        except Exception as exc:
            logger.exception("engine thread died")
            if self.on_death is not None:
                self.on_death(f"the engine stopped: {str(exc).strip().splitlines()[0]}")
        finally:
            self.alive = False
            self._fail_all()

    def _report(self, stats: StepStats) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(stats)
        except Exception:  # a broken exporter must not stop serving
            logger.exception("on_step hook failed")

    def _fail_all(self, reason: str = "the engine stopped") -> None:
        with self._lock:
            pending = list(self._queues.items())
            # Failed once: a second call (the engine thread ending after `fail`) adds nothing.
            self._queues.clear()
        for request_id, (loop, queue) in pending:
            out = RequestOutput(
                request_id, [], "", finished=True, finish_reason="error", error=reason
            )
            loop.call_soon_threadsafe(queue.put_nowait, out)
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for _, _, _, admitted in inbox:
            admitted.get_loop().call_soon_threadsafe(_resolve, admitted, EngineDead(reason))


class RequestStream:
    """The outputs of one admitted request, until all its n sequences finished. Leaving
    the iteration early (a client that went away) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, queue: asyncio.Queue) -> None:
        self._engine = engine
        self.request_id = request_id
        self._remaining = n
        self._queue = queue

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while self._remaining:
                out = await self._queue.get()
                if out.finished:
                    self._remaining -= 1
                yield out
        finally:
            self.close()

    def close(self) -> None:
        """Stops listening; aborts the request if it has not finished."""
        self._engine._release(self.request_id)
        if self._remaining:
            self._remaining = 0
            self._engine.abort(self.request_id)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
