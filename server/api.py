"""The FastAPI application: routes of the OpenAI-compatible API plus health, tokenizer
and metrics endpoints. Handlers translate between the wire and the engine; they never
touch KV blocks or model tensors."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from server.edge.errors import APIError, install_error_handlers
from server.edge.metrics import CONTENT_TYPE, ServerMetrics
from server.edge.middleware import BodyLimit, RequestContext
from server.routes.chat import create_chat_completion
from server.routes.chat_inputs import render_chat
from server.routes.completions import create_completion
from server.routes.embeddings import create_embedding
from server.routes.engine_inputs import check_token_ids
from server.routes.messages import add_messages_endpoints
from server.routes.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from server.routes.responses import create_response
from server.routes.responses_protocol import ResponsesRequest
from server.routes.routing import add_routing_endpoints
from server.state import ServerState


def build_app(
    state: ServerState, metrics: ServerMetrics, allowed_origins: list[str] | None = None
) -> FastAPI:
    app = FastAPI(title="llamaserve", version="0.1.0")
    app.state.llamaserve = state
    install_error_handlers(app)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    app.add_middleware(RequestContext, on_status=metrics.count_response)

    keys = [key.encode() for key in state.api_keys]

    def authorized(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Anthropic's clients send the key in `x-api-key` rather than as a bearer token.
        offered = [token.strip().encode()] if scheme.lower() == "bearer" else []
        if "x-api-key" in request.headers:
            offered.append(request.headers["x-api-key"].strip().encode())
        # Every key is compared, in constant time, so the answer's timing tells nothing
        # about which key came close.
        matches = [hmac.compare_digest(given, key) for given in offered for key in keys]
        if not any(matches):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if not state.serves(model):
            raise APIError(
                404,
                # A name is echoed only in part: a client may send megabytes of it.
                f"the model `{(model or '')[:200]}` does not exist",
                "model",
                code="model_not_found",
            )

    def check_generates(model: str | None) -> None:
        check_model(model)
        if state.embedding is not None:
            raise APIError(
                400,
                f"the model `{state.model_name}` is an embedding model and generates no "
                "text; use /v1/embeddings",
                "model",
            )

    guarded = [Depends(authorized)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        check_generates(req.model)
        return await create_completion(req, raw, state)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        check_generates(req.model)
        return await create_chat_completion(req, raw, state)

    @app.post("/v1/responses", dependencies=guarded)
    async def responses(req: ResponsesRequest, raw: Request) -> Any:
        check_generates(req.model)
        return await create_response(req, raw, state)

    @app.post("/v1/embeddings", dependencies=guarded)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        check_model(req.model)
        return await create_embedding(req, raw, state)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> ModelList:
        names = [state.model_name, *state.extra_model_names]
        cards = [ModelCard(id=n, max_model_len=state.max_model_len, task=state.task) for n in names]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.alive:
            return Response(status_code=200)
        return JSONResponse({"error": {"message": "engine is not running"}}, status_code=503)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            # The function chat completions use, so these are the ids the engine would get.
            ids = render_chat(
                req.messages, state, req.add_generation_prompt, req.chat_template_kwargs
            )
        else:
            # The same ids /v1/completions gives this prompt: special-token text is special.
            ids = state.tokenizer.encode(
                req.prompt or "",
                allow_special=True,
                add_bos=None if req.add_special_tokens else False,
            )
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        check_token_ids(req.tokens, state, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    # Open by default, as Prometheus scrapes without credentials; guarded on request.
    @app.get("/metrics", dependencies=guarded if state.metrics_require_api_key else [])
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_routing_endpoints(app, state, guarded, check_model)
    add_messages_endpoints(app, state, guarded, check_generates)
    return app
