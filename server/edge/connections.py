"""What an HTTP connection may cost the server: how long it may take to send a request
head, and how many connections and requests may be in flight at once.

uvicorn already bounds an idle keep-alive connection (`timeout_keep_alive`), the size of
a request head (h11's incomplete-event limit) and the accept queue (`backlog`), but not
the time a client takes to send its head: a client that connects and sends nothing, or
sends its headers a byte at a time (slowloris), keeps its socket, its file descriptor and
its place under `limit_concurrency` forever, and a few hundred of them lock everyone else
out. `BoundedH11Protocol` closes such a connection once `header_timeout_s` passed, and
answers requests over `limit_concurrency` with a 503 in OpenAI's error shape instead of
uvicorn's plain-text one.

It never reads request bodies and never looks at what a request asks for: once a head is
in, the request is the app's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from server.edge.errors import error_body
from server.routes.streaming import RETRY_AFTER_S

logger = logging.getLogger("llamaserve.server")

# Sent to a client that began a head and did not finish it, so a slow but honest client
# learns why; a connection that sent nothing is closed without a word.
REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head.

    The deadline starts when the connection opens, or when the first byte of a later
    request arrives on a kept-alive one (uvicorn's keep-alive timer covers the idle time
    between requests, and stops at that byte). It is never pushed back by further bytes:
    a slowloris client sends a byte just often enough to defeat an idle timeout.
    """

    header_timeout_s: float = 10.0
    _head_deadline: asyncio.TimerHandle | None = None

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if self.limit_concurrency is not None:
            self.app = ConcurrencyLimit(self.app, self.limit_concurrency, server_state)
            self.limit_concurrency = None  # uvicorn's own check would answer in plain text

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 leaves IDLE only once a whole request head has been parsed.
        if self.conn.their_state is h11.IDLE:
            self._arm_head_deadline()
        else:
            self._cancel_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        partial_head, _ = self.conn.trailing_data
        if partial_head:
            self.transport.write(REQUEST_TIMEOUT)
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown client"
        logger.info(
            "closed connection from %s: no complete request head within %gs",
            client,
            self.header_timeout_s,
        )
        self.transport.close()


class ConcurrencyLimit:
    """Answers 503 while more than `limit` connections are open or requests in flight
    (this one included), as uvicorn's `limit_concurrency` does, in OpenAI's shape."""

    def __init__(self, app: ASGIApp, limit: int, server_state: ServerState) -> None:
        self.app = app
        self.limit = limit
        self.server_state = server_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.server_state
        if len(state.connections) > self.limit or len(state.tasks) > self.limit:
            body = error_body(503, "server overloaded: too many connections", code="overloaded")
            await JSONResponse(body, 503, headers={"Retry-After": RETRY_AFTER_S})(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)


def bounded_http_protocol(header_timeout_s: float) -> type[BoundedH11Protocol]:
    """The protocol class to hand uvicorn (`Config(http=...)`), which builds one per
    connection from its config alone: the timeout travels as a class attribute."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": header_timeout_s})
