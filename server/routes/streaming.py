"""Running engine requests for one HTTP request: admission of all its sub-requests
before any byte is sent (so refusals are proper 4xx/503 answers), merging their outputs,
SSE framing, and cancelling everything when the client goes away.

It never blocks the event loop on the engine and never lets a request outlive its
client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from scheduler import (
    EngineDead,
    InvalidParams,
    QueueFull,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from server.edge.errors import APIError
from server.routes.engine_inputs import client_error
from server.state import ServerState

T = TypeVar("T")
RETRY_AFTER_S = "1"


async def admit(
    state: ServerState,
    jobs: list[tuple[str, list[int], SamplingParams]],
    names: dict[str, str] | None = None,
    model: str | None = None,
) -> list[RequestStream]:
    """Admits every job or none, with the LoRA adapter `model` names if it names one; a
    refusal becomes the client's error (`names`: the client's names for the scheduler's
    fields, as `client_error` takes them)."""
    lora = state.lora_for(model)
    extra = [lora] if lora is not None else []  # a pooling engine takes no adapter
    # All at once: the engine thread takes its whole inbox between two steps, so a call of
    # many prompts or inputs is admitted in one round trip rather than a step each.
    added = [state.engine.add_request(rid, ids, params, *extra) for rid, ids, params in jobs]
    results = await asyncio.gather(*added, return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    refusals = [r for r in results if isinstance(r, BaseException)]
    if refusals:
        for stream in streams:
            stream.close()
        exc = refusals[0]
        if isinstance(exc, QueueFull):
            raise APIError(
                503,
                f"server overloaded: {exc}",
                code="overloaded",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from None
        if isinstance(exc, EngineDead):
            raise APIError(
                503, "the engine is not running", headers={"Retry-After": RETRY_AFTER_S}
            ) from None
        if isinstance(exc, InvalidParams):
            raise client_error(exc, names) from None
        raise exc
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work` but cancels it if the client disconnects first (the body has been
    read, so the next ASGI message can only be the disconnect)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
