"""Hands one request to the process of the model its body names and its answer back,
byte for byte: server-sent events pass through as the model's server writes them.

Any route works, present or future, as long as its JSON body names a `model`: chat,
completions, responses, embeddings, rerank and score, Anthropic's messages, tokenize.
A client that goes away closes the connection to the model's server, which then aborts
the request and frees its KV blocks, as it would for a client of its own. A model whose
process ends mid-answer ends that answer with an error event; nothing else is affected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.edge.errors import APIError, error_body
from server.multimodel.pool import ModelPool, ModelUnavailable

logger = logging.getLogger("llamaserve.models")

# Hop-by-hop headers, and those the front sets itself (the key is the model process's).
_REQUEST_DROPPED = {
    "host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "content-length", "authorization", "x-api-key", "proxy-authorization",
}  # fmt: skip
_RESPONSE_DROPPED = {"connection", "keep-alive", "transfer-encoding", "x-request-id"}


def requested_model(body: bytes) -> str:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    name = document.get("model") if isinstance(document, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "model: this server serves several models; name one", "model")
    return name


class ProxiedStream(StreamingResponse):
    """Closes the model server's response however the client's ends: finished,
    disconnected (the task cancelled) or a failed write."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(chunks, status_code=status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def known_model(body: bytes, pool: ModelPool) -> str:
    name = requested_model(body)
    if name not in pool.entries:
        raise APIError(
            404, f"the model `{name[:200]}` does not exist", "model", code="model_not_found"
        )
    return name


def unavailable(exc: ModelUnavailable) -> APIError:
    retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    return APIError(503, str(exc), "model", code=exc.code, headers=retry)


async def forward(request: Request, pool: ModelPool, client: httpx.AsyncClient) -> ProxiedStream:
    body = await request.body()
    name = known_model(body, pool)
    try:
        process = await pool.acquire(name)
    except ModelUnavailable as exc:
        raise unavailable(exc) from None
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_DROPPED}
    headers["authorization"] = f"Bearer {process.key}"
    headers["x-request-id"] = request.state.request_id
    query = f"?{request.url.query}" if request.url.query else ""
    url = process.base_url + request.url.path + query
    try:
        upstream = await client.send(
            client.build_request(request.method, url, headers=headers, content=body), stream=True
        )
    except BaseException as exc:
        pool.release(name)  # also when the request is cancelled while it waits
        if not isinstance(exc, httpx.HTTPError):
            raise
        logger.error("request %s: model %s: %r", request.state.request_id, name, exc)
        raise APIError(
            503,
            f"the model `{name}` failed before answering: its process stopped responding",
            "model",
            code="model_failed",
        ) from None
    events = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.error(
                "request %s: model %s ended mid-answer: %r", request.state.request_id, name, exc
            )
            if events:
                message = f"the model `{name}` stopped during the answer: its process ended"
                event = error_body(503, message, "model", "model_failed")
                yield f"data: {json.dumps(event)}\n\n".encode()

    async def close() -> None:
        await upstream.aclose()
        pool.release(name)

    response_headers = {
        k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROPPED
    }
    return ProxiedStream(
        chunks(), close, status_code=upstream.status_code, headers=response_headers
    )
