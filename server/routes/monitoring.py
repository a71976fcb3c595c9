"""What an orchestrator, a client's probe and a scraper read: `GET /health` (200 while the
engine runs, 503 once it has died), `HEAD /` and `GET /` (Claude Code probes the server
with `HEAD /` before its first request; the chat page, server/webui/, answers both instead
unless --no-webui turns it off) and `GET /metrics` (the Prometheus text
`ServerMetrics` renders). Two routers, as the app's assembly guards them differently:
/health and / are always open, /metrics only when asked to be."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.edge.metrics import CONTENT_TYPE, ServerMetrics
from server.state import served_state

health_router = APIRouter()
metrics_router = APIRouter()


@health_router.get("/health")
async def health(raw: Request) -> Response:
    if served_state(raw).engine.alive:
        return Response(status_code=200)
    return JSONResponse({"error": {"message": "engine is not running"}}, status_code=503)


@health_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> Response:
    return Response(status_code=200)


@metrics_router.get("/metrics")
async def prometheus_metrics(raw: Request) -> Response:
    metrics: ServerMetrics = raw.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE)
