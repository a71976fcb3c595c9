"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right
status, for everything a client can get wrong, and one handler that turns our own bugs
into a logged 500 without a traceback on the wire. On the routes of Anthropic's Messages
API the same errors take Anthropic's shape (server/edge/anthropic_errors.py).

It must never put a traceback or an internal message on the wire.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.edge.anthropic_errors import anthropic_error_body, anthropic_status, speaks_anthropic

logger = logging.getLogger("llamaserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """`path`: the request's; the routes of Anthropic's API answer in its shape."""
    if speaks_anthropic(path):
        status = anthropic_status(status)
        body = anthropic_error_body(status, message)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    forms = _union_branches(errors, loc)
    if forms:
        # A value that fits no form of a union (`input` as a list mixing texts and
        # token ids): pydantic reports each form's complaint; the field and its forms
        # say more than the first complaint alone.
        return f"{loc[0]}: expected one of {', '.join(forms)}", loc[0]
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


def _union_branches(errors: list[Any], loc: list[str]) -> list[str]:
    """The forms of a union field none of which the value fits; [] if not that case."""
    if len(loc) < 2:
        return []
    tags: list[str] = []
    for error in errors:
        path = [p for p in error.get("loc", ()) if p != "body"]
        if len(path) < 2 or path[0] != loc[0] or not isinstance(path[1], str):
            return []
        if path[1] not in tags:
            tags.append(path[1])
    return tags if len(tags) > 1 else []


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status, exc.message, exc.param, exc.code, exc.headers, request.url.path
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        headers = getattr(exc, "headers", None)
        return error_response(exc.status_code, message, headers=headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", "-")
        logger.exception("request %s: internal error", request_id)
        message = f"internal error (request id {request_id})"
        return error_response(500, message, path=request.url.path)
