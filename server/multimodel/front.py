"""The app of a several-model server: it owns no model. It answers `GET /v1/models` (every
known model and its status), `POST /models/load` and `/models/unload` (llama-server's
names), /health and /metrics itself, and hands every other POST to the process of the
model its body names (proxy.py), whatever the route.

Errors keep the single-model server's shapes (server/edge/errors.py), Anthropic's on
its routes; the API key is checked here, once, before a model is loaded for anyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from server.edge.errors import install_error_handlers
from server.edge.metrics import CONTENT_TYPE
from server.edge.middleware import install_edge
from server.multimodel.front_metrics import FrontMetrics
from server.multimodel.memory import rss_bytes
from server.multimodel.pool import ModelPool, ModelUnavailable
from server.multimodel.proxy import forward, known_model, unavailable
from server.routes.guards import check_api_key


def model_card(pool: ModelPool, name: str, created: int) -> dict[str, Any]:
    entry = pool.entries[name]
    process = entry.process
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "llamaserve",
        "status": entry.status,
        "memory_estimate_bytes": entry.estimate_bytes,
        "rss_bytes": rss_bytes(process.pid) if process is not None else 0,
    }
    if entry.status == "failed":
        card["reason"] = entry.reason
    return card


def build_front(
    pool: ModelPool,
    api_keys: list[str],
    max_request_bytes: int = 8 * 2**20,
    metrics_require_api_key: bool = False,
    allowed_origins: list[str] | None = None,
) -> FastAPI:
    # No read timeout: a long generation streams for as long as it takes.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )
    # One line per proxied request from httpx would double the access log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    metrics = FrontMetrics(pool)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.close()
        await client.aclose()

    app = FastAPI(title="llamaserve", version="0.1.0", lifespan=lifespan)
    app.state.pool = pool
    install_error_handlers(app)
    install_edge(app, allowed_origins, max_request_bytes)

    def guarded(request: Request) -> None:
        check_api_key(request, api_keys)

    guard = [Depends(guarded)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        return Response(status_code=200)

    @app.get("/metrics", dependencies=guard if metrics_require_api_key else [])
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(client), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=guard)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(pool, n, created) for n in pool.entries]}

    add_model_routes(app, pool, guard, created)

    @app.post("/{path:path}", dependencies=guard)
    async def proxied(request: Request, path: str) -> Response:
        return await forward(request, pool, client)

    return app


def add_model_routes(app: FastAPI, pool: ModelPool, guard: list[Any], created: int) -> None:
    """llama-server's `POST /models/load` and `/models/unload`, body `{"model": NAME}`."""

    @app.post("/models/load", dependencies=guard)
    async def load(request: Request) -> dict[str, Any]:
        name = known_model(await request.body(), pool)
        try:
            await pool.acquire(name, count=False)
        except ModelUnavailable as exc:
            raise unavailable(exc) from None
        return {"success": True, **model_card(pool, name, created)}

    @app.post("/models/unload", dependencies=guard)
    async def unload(request: Request) -> dict[str, Any]:
        name = known_model(await request.body(), pool)
        await pool.unload(name)
        return {"success": True, **model_card(pool, name, created)}
