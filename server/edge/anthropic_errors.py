"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for the
routes of its Messages API (`/v1/messages` and below), whose clients (the `anthropic`
SDK, Claude Code) read that shape and pick their exception class by status.

It only names the shape and the statuses; which routes speak it is decided by path, so
every error on them, from validation to the body-size bound, answers the same way.
"""

from __future__ import annotations

MESSAGES_PATH = "/v1/messages"

# Anthropic's error types by status; 529 is its "overloaded", where OpenAI's side says 503.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
# Our statuses that Anthropic spells otherwise: a refused admission (or a stopped engine)
# is its 529, and a body that fails validation is a plain 400.
_STATUSES = {503: 529, 422: 400}


def speaks_anthropic(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(status: int) -> int:
    return _STATUSES.get(status, status)


def anthropic_error_body(status: int, message: str) -> dict:
    """The body for `status` as it goes on the wire (after `anthropic_status`)."""
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
