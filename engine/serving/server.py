"""OpenAI-compatible HTTP server over one EngineService (FastAPI + uvicorn).

    python -m engine.serving.server --model smollm2-135m --host 127.0.0.1 --port 8000

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as SSE
ending with `data: [DONE]`, or not), GET /metrics (Prometheus), GET /health.
Every connection shares the service's single engine thread; handlers only submit requests and
relay their RequestOutput deltas. A request whose client goes away is aborted, which frees its
KV blocks. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}.

This module assembles the app (create_app, error handlers) and holds the CLI; the parts live
beside it: routes.py (the handlers), http_guard.py (checks before any route runs),
http_limits.py (body and header limits), http_server.py (uvicorn, shutdown drain, a background
thread), server_state.py (what they share).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.cli import add_engine_args, config_from_args
from engine.serving.http_guard import RequestGuard, allowed_hosts_for, json_error
from engine.serving.http_limits import HTTPLimits
from engine.serving.http_server import DrainingServer, uvicorn_config
from engine.serving.protocol import APIError, error_body
from engine.serving.routes import add_routes
from engine.serving.server_state import ServerState


def create_app(
    service: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_service: bool = False,
    metrics_auth: bool = True,
    allowed_hosts: Collection[str] | None = None,
    limits: HTTPLimits | None = None,
) -> FastAPI:
    """The ASGI app. With shutdown_service the service is shut down with the app.
    allowed_hosts: the Host (and Origin) names accepted; None accepts any (see
    `allowed_hosts_for` for what a bind address implies)."""
    model_name = served_model_name or service.model_name
    state = ServerState(
        service=service,
        model_name=model_name,
        aliases=frozenset({service.model_name, service.config.model}) - {model_name},
        api_key=api_key,
        metrics_auth=metrics_auth,
        allowed_hosts=None
        if allowed_hosts is None
        else frozenset(h.lower() for h in allowed_hosts),
        limits=limits or HTTPLimits(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.draining = True
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if shutdown_service:
            await asyncio.to_thread(service.shutdown)

    # No /docs, /redoc, /openapi.json: the API is OpenAI's (documented there), and an open
    # schema route would be one more thing the API key has to cover.
    app = FastAPI(
        title="inference-playground", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )  # fmt: skip
    app.state.server = state
    _add_error_handlers(app)
    add_routes(app, state)
    app.add_middleware(RequestGuard, state=state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return json_error(err, close=err.status_code in (408, 413))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = err.detail if err.status_code != 404 else None
        message = message or f"Invalid URL ({request.method} {request.url.path})"
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(error_body(str(message), code=code), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(err)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        body = error_body(f"{type(err).__name__}: {err}", type="internal_server_error")
        return JSONResponse(body, status_code=500)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """The HTTP hardening flags (HTTPLimits, auth scope, Host checks)."""
    d = HTTPLimits()
    p.add_argument(
        "--metrics-no-auth",
        action="store_true",
        help="with --api-key: leave /metrics open (for a Prometheus scraper)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=[],
        metavar="HOST",
        help="Host/Origin names accepted besides localhost on a loopback bind; on "
        "another bind, when given, the only ones accepted",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="larger request bodies get 413 (default 4 MiB)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longer text prompts get 400 before tokenizing (default: 16 x max_model_len)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        metavar="S",
        help="seconds for a request's line and headers to arrive",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help="seconds for a request's body to arrive (else 408)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=d.keep_alive_timeout_s,
        metavar="S",
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s, metavar="S",
                   help="on shutdown, seconds in-flight requests get before they are aborted")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.serving.server",
        description="OpenAI-compatible server over the engine.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    p.add_argument("--served-model-name", default=None, help="name for 'model' (default: model)")
    p.add_argument("--log-level", default="info")
    _add_http_args(p)
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine import EngineService  # after parsing, so that --help answers at once

    try:
        config = config_from_args(args)
        service = EngineService(config)
    except (ValueError, OSError) as e:  # a bad flag or --model path: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(
        service,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        shutdown_service=True,
        metrics_auth=not args.metrics_no_auth,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
        limits=HTTPLimits(
            max_body_bytes=args.max_body_bytes,
            max_prompt_chars=args.max_prompt_chars,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_timeout_s=args.timeout_keep_alive,
            drain_timeout_s=args.drain_timeout,
        ),
    )
    uv_config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level)
    # uvicorn shuts down cleanly on Ctrl+C, then re-raises the signal: that is a normal exit.
    with contextlib.suppress(KeyboardInterrupt):
        DrainingServer(uv_config, app.state.server).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
