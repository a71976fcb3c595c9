"""Serves the chat page: `GET /` (and `HEAD /`, which probes such as Claude Code's send)
answers index.html, `/webui/NAME` the page's own scripts, style and icon. Only the files
listed here are served, read once from the package, so no path a client sends reaches the
file system.

Every answer carries a Content-Security-Policy that allows scripts, styles, images and
connections from this origin only and no inline script: the page renders model output,
which is untrusted, and the policy is the second wall should the renderer ever let
markup through.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from server.edge.errors import APIError

router = APIRouter(include_in_schema=False)

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page is small and changes with the package; revalidating costs one round trip.
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
ASSETS = (
    "app.js",
    "chat.js",
    "api.js",
    "markdown.js",
    "highlight.js",
    "store.js",
    "dialogs.js",
    "view.js",
    "style.css",
    "icon.svg",
)


@cache
def asset(name: str) -> bytes:
    return files("server.webui").joinpath("static", name).read_bytes()


def asset_response(name: str) -> Response:
    media_type = MEDIA_TYPES[name[name.rindex(".") :]]
    return Response(asset(name), media_type=media_type, headers=HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
async def index() -> Response:
    return asset_response("index.html")


@router.get("/webui/{name}")
async def static_file(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no such file: /webui/{name[:200]}", code="not_found")
    return asset_response(name)
