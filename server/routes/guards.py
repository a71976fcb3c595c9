"""What a request must pass before its handler runs: the API key (a dependency the app's
assembly attaches to the routes it guards), a model name this server answers to, and a
model that generates text. Each refusal is an `APIError` in OpenAI's error shape."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.edge.errors import APIError
from server.state import ServerState, served_state


def authorized(request: Request) -> None:
    """Lets the request through when no key is configured or it bears one of the keys."""
    check_api_key(request, served_state(request).api_keys)


def check_api_key(request: Request, api_keys: list[str]) -> None:
    keys = [key.encode() for key in api_keys]
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    offered = [token.strip().encode()] if scheme.lower() == "bearer" else []
    # Anthropic's clients send the key in `x-api-key` rather than as a bearer token.
    if "x-api-key" in request.headers:
        offered.append(request.headers["x-api-key"].strip().encode())
    # Every key is compared, in constant time, so the answer's timing tells nothing
    # about which key came close.
    matches = [hmac.compare_digest(given, key) for given in offered for key in keys]
    if not any(matches):
        raise APIError(401, "invalid or missing API key", code="invalid_api_key")


def check_model(model: str | None, state: ServerState) -> None:
    if not state.serves(model):
        raise APIError(
            404,
            # A name is echoed only in part: a client may send megabytes of it.
            f"the model `{(model or '')[:200]}` does not exist",
            "model",
            code="model_not_found",
        )


def check_generates(model: str | None, state: ServerState) -> None:
    check_model(model, state)
    if state.task == "embed":
        raise APIError(
            400,
            f"the model `{state.model_name}` is an embedding model and generates no "
            "text; use /v1/embeddings",
            "model",
        )
    if state.task == "score":
        raise APIError(
            400,
            f"the model `{state.model_name}` is a cross-encoder and generates no text; "
            "use /v1/rerank or /score",
            "model",
        )
