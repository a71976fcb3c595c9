"""The FastAPI application, assembled: the state and metrics every handler reads stored on
the app, the error handlers, the middleware, and the routers of server/routes/ (the
OpenAI API, rerank and score, tokens, health, metrics, the router-facing endpoints,
Anthropic's Messages API), each attached with the guard it needs, and the chat page at `/`
(server/webui/) unless it is turned off. Handlers translate between the wire and the
engine; they never touch KV blocks or model tensors."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from server.edge.errors import install_error_handlers
from server.edge.metrics import ServerMetrics
from server.edge.middleware import install_edge
from server.routes import (
    adapters,
    messages,
    monitoring,
    openai_api,
    routing,
    scoring_api,
    tokens,
)
from server.routes.guards import authorized
from server.state import ServerState
from server.webui import page


def build_app(
    state: ServerState,
    metrics: ServerMetrics,
    allowed_origins: list[str] | None = None,
    webui: bool = True,
) -> FastAPI:
    app = FastAPI(title="llamaserve", version="0.1.0")
    app.state.llamaserve = state
    app.state.metrics = metrics
    install_error_handlers(app)
    install_edge(app, allowed_origins, state.max_request_bytes, metrics.count_response)

    guarded = [Depends(authorized)]
    app.include_router(openai_api.router, dependencies=guarded)
    app.include_router(scoring_api.router, dependencies=guarded)
    app.include_router(adapters.router, dependencies=guarded)
    # Open like /health: the page holds no secret and asks for the key the API wants.
    # Included before health_router, so that its `/` wins over the bare probe answer there.
    if webui:
        app.include_router(page.router)
    app.include_router(monitoring.health_router)
    app.include_router(tokens.router, dependencies=guarded)
    # Open by default, as Prometheus scrapes without credentials; guarded on request.
    app.include_router(
        monitoring.metrics_router, dependencies=guarded if state.metrics_require_api_key else []
    )
    app.include_router(routing.router, dependencies=guarded)
    app.include_router(messages.router, dependencies=guarded)
    return app
