"""The checks every HTTP request passes before any route runs or any body byte is read (Host
and Origin, the API key, JSON-only POSTs, the declared body size, draining), and the Host
names a bind address implies. Refusals use OpenAI's error shape (json_error)."""

from __future__ import annotations

import hmac
import urllib.parse
from collections.abc import Collection

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.serving.http_limits import too_large
from engine.serving.protocol import APIError, bad_request
from engine.serving.server_state import ServerState

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts_for(bind_host: str, extra: Collection[str] = ()) -> frozenset[str] | None:
    """The Host values a server bound to bind_host accepts: on a loopback bind only loopback
    names (a web page cannot reach it through a DNS name rebound to 127.0.0.1), plus extra;
    on another bind any Host unless extra names some."""
    names = {h.lower() for h in extra}
    if bind_host.lower().strip("[]") in LOOPBACK_HOSTS:
        return frozenset(LOOPBACK_HOSTS | names | {bind_host.lower().strip("[]")})
    if names:
        return frozenset(names | {bind_host.lower().strip("[]")})
    return None


def json_error(err: APIError, close: bool = False) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status_code == 401 else {}
    if close:  # the rest of the request will not be read: the connection cannot be reused
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


class RequestGuard:
    """Checks every HTTP request before any route runs or any body byte is read, answering in
    OpenAI's error shape: Host and Origin (DNS rebinding, cross-site pages), the API key (every
    route but /health), JSON-only POST bodies (a cross-site form or `text/plain` fetch cannot
    send application/json without a CORS preflight, which this server never grants), the
    declared body size, and draining. Pure ASGI, so streaming and disconnects pass untouched."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            err = self._check(scope, Headers(scope=scope))
            if err is not None:
                await json_error(err, close=err.status_code == 413)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: Headers) -> APIError | None:
        state, path, method = self.state, scope["path"], scope["method"]
        if state.allowed_hosts is not None:
            if _hostname(headers.get("host", "")) not in state.allowed_hosts:
                return APIError(400, "Invalid Host header", code="invalid_host")
            origin = headers.get("origin")
            if origin is not None and _origin_host(origin) not in state.allowed_hosts:
                return APIError(403, f"Origin {origin!r} is not allowed", code="invalid_origin")
        open_route = path == "/health" or (path == "/metrics" and not state.metrics_auth)
        if not (state.api_key is None or open_route or _authorized(headers, state.api_key)):
            return APIError(
                401,
                "Incorrect or missing API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )
        if method == "POST":
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                return APIError(
                    415,
                    f"Content-Type must be application/json, got {media_type or 'none'!r}",
                    code="unsupported_media_type",
                )
            declared = headers.get("content-length")
            if declared is not None:
                if not declared.isdigit():
                    return bad_request("Content-Length: not a number")
                if int(declared) > state.limits.max_body_bytes:
                    return too_large(state.limits.max_body_bytes)
        if state.draining and path not in ("/health", "/metrics"):
            return APIError(503, "the server is shutting down", type="service_unavailable")
        return None


def _hostname(host: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _origin_host(origin: str) -> str | None:
    try:
        return urllib.parse.urlsplit(origin.strip()).hostname
    except ValueError:
        return None


def _authorized(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # Compared as bytes: hmac.compare_digest raises TypeError on non-ASCII str, and a header
    # is whatever bytes the client sent (Starlette decodes them as latin-1).
    given = token.strip().encode("latin-1", errors="replace")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())
