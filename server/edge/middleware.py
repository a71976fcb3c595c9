"""Cross-cutting HTTP concerns, as plain ASGI middleware: a request id on every request
(the client's `X-Request-Id` or a new one) with one access-log line and one status report
(for the error counters) when it ends, and a bound on body size that answers 413 before
the body reaches JSON parsing.

It never parses a body or looks at what a route answers beyond its status. `install_edge`
puts them, with CORS where origins are allowed, on an app: the one-model server's and the
several-model front's alike.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.edge.anthropic_errors import anthropic_error_body, speaks_anthropic
from server.edge.errors import error_body

access_log = logging.getLogger("llamaserve.access")


def install_edge(
    app: FastAPI,
    allowed_origins: list[str] | None,
    max_request_bytes: int,
    on_status: Callable[[int], None] | None = None,
) -> None:
    """CORS (only where origins are allowed), the body bound and the request context, in
    the order every app of the server stacks them."""
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(RequestContext, on_status=on_status)


class RequestContext:
    """Assigns the request id, writes the access-log line and reports the final status
    to `on_status`."""

    def __init__(self, app: ASGIApp, on_status: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        client_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128]
        internal = uuid.uuid4().hex
        # Engine ids must be unique even when clients reuse theirs.
        request_id = f"{client_id}-{internal[:8]}" if client_id else internal
        state: dict[str, Any] = scope.setdefault("state", {})
        state.update(request_id=request_id, prompt_tokens=0, completion_tokens=0)
        echoed = (client_id or request_id).encode("latin-1", errors="replace")
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", echoed)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access_log.info(
                "%s %s %s %d prompt_tokens=%d completion_tokens=%d %.3fs",
                request_id,
                scope["method"],
                scope["path"],
                status,
                state.get("prompt_tokens", 0),
                state.get("completion_tokens", 0),
                time.perf_counter() - started,
            )
            if self.on_status is not None:
                self.on_status(status)


# A client still sending when the server answers and closes gets a connection reset
# instead of the 413; reading (and dropping) the rest of a body up to this size avoids it.
DRAIN_LIMIT_BYTES = 64 * 2**20


async def _drain(receive: Receive) -> None:
    drained = 0
    while drained <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


class BodyLimit:
    """Reads the whole body up to `max_bytes` and replays it, or answers 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= DRAIN_LIMIT_BYTES:
                await _drain(receive)
            await self._reject(send, scope["path"])
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                await self._reject(send, scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send, path: str) -> None:
        message = f"request body larger than {self.max_bytes} bytes"
        shaped = anthropic_error_body if speaks_anthropic(path) else error_body
        payload = json.dumps(shaped(413, message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": payload})
