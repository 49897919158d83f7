"""OpenAI-compatible HTTP server over one EngineService (FastAPI + uvicorn).

    python -m engine.serving.server --model smollm2-135m --host 127.0.0.1 --port 8000

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as SSE
ending with `data: [DONE]`, or not), GET /metrics (Prometheus), GET /health.
Every connection shares the service's single engine thread; handlers only submit requests and
relay their RequestOutput deltas. A request whose client goes away is aborted, which frees its
KV blocks. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.cli import add_engine_args, config_from_args
from engine.config import DEFAULT_MAX_MODEL_LEN
from engine.serving import streams as server_streams
from engine.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    chat_response,
    completion_prompt,
    completion_response,
    error_body,
    from_validation_error,
    sampling_params,
    unencodable_string,
    usage,
)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may cost the server (docs/serving.md, "Limits")."""

    max_body_bytes: int = 4 * 2**20  # a larger body is answered 413 before it is read
    # A text prompt (or a chat's contents) longer than this is refused before tokenizing it;
    # None: 16 characters per token of max_model_len (real text averages about 4).
    max_prompt_chars: int | None = None
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 30.0  # the whole body must arrive within this (else 408)
    keep_alive_timeout_s: int = 5  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 5.0  # shutdown: in-flight requests get this long to finish


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass
class ServerState:
    service: Any  # EngineService
    model_name: str  # the name clients send as "model" and see in /v1/models
    aliases: frozenset[str]  # other names accepted as "model" (e.g. the engine's model spec)
    api_key: str | None = None
    metrics_auth: bool = True  # /metrics needs the key too (False: open for a scraper)
    # Host / Origin values accepted (DNS rebinding, cross-site requests); None: any.
    allowed_hosts: frozenset[str] | None = None
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    draining: bool = False  # shutting down: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: set[str] = field(default_factory=set)  # request ids being answered
    # Tokenizing a long prompt takes seconds: it runs here, not on the event loop. One thread:
    # HF fast tokenizers are not safe to call from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    )

    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested == self.model_name or requested in self.aliases:
            return self.model_name
        raise bad_request(
            f"model: '{requested}' is not served here (served: '{self.model_name}')",
            param="model",
            code="model_not_found",
        )

    def max_prompt_chars(self) -> int:
        limit = self.limits.max_prompt_chars
        return limit if limit is not None else 16 * _max_model_len(self.service)


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
    _add_routes(app, state)
    app.add_middleware(_Guard, state=state)
    return app


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


def _json_error(err: APIError, close: bool = False) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status_code == 401 else {}
    if close:  # the rest of the request will not be read: the connection cannot be reused
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return _json_error(err, close=err.status_code in (408, 413))

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


class _Guard:
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
                await _json_error(err, close=err.status_code == 413)(scope, receive, send)
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
                    return _too_large(state.limits.max_body_bytes)
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


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def _read_body(request: Request, limits: HTTPLimits) -> bytes:
    """The body, at most max_body_bytes (a chunked body declares no length) and within
    body_timeout_s (a client trickling bytes holds a connection and a task until then)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(limits.max_body_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
            code="request_timeout",
        ) from None  # fmt: skip
    return b"".join(chunks)


async def _parse(request: Request, model: type[BaseModel], limits: HTTPLimits) -> Any:
    body = await _read_body(request, limits)
    try:
        # parse_constant: Python's json reads NaN/Infinity, which JSON does not have.
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    where = unencodable_string(obj)
    if where is not None:  # a lone surrogate ("\ud800") is valid JSON but no text
        raise bad_request(f"{where}: not valid Unicode text (lone surrogate)", param=where)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _submit(
    state: ServerState, prompt: Callable[[], Any] | Any, req: Any, max_tokens: Any,
    request_id: str,
) -> tuple[Any, Any]:  # fmt: skip
    """Tokenize (and template) off the loop, then submit; returns (stream, params). A client
    gone while its prompt was tokenized still has its request aborted once submitted."""
    service = state.service

    def work() -> tuple[Any, Any]:
        ids = prompt() if callable(prompt) else prompt
        n = max_tokens(ids) if callable(max_tokens) else max_tokens
        params = sampling_params(req, n)
        return server_streams.submit(service, ids, params, request_id), params

    future = asyncio.get_running_loop().run_in_executor(state.tokenize_pool, work)
    try:
        result = await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(
            lambda f: f.cancelled() or f.exception() is not None or service.abort(request_id)
        )
        raise
    state.inflight.add(request_id)
    return result


def _check_prompt_size(state: ServerState, num_chars: int, param: str) -> None:
    limit = state.max_prompt_chars()
    if num_chars > limit:
        raise bad_request(
            f"{param}: {num_chars} characters exceed this server's limit of {limit} "
            "(--max-prompt-chars)",
            param=param,
            code="prompt_too_long",
        )


async def _tracked(state: ServerState, request_id: str, events: AsyncIterator[str]) -> Any:
    try:
        async for event in events:
            yield event
    finally:
        state.inflight.discard(request_id)
        await events.aclose()  # type: ignore[attr-defined]


def _add_routes(app: FastAPI, state: ServerState) -> None:
    service = state.service

    @app.get("/health")
    async def health() -> Response:
        is_alive = getattr(service, "is_alive", None)
        if is_alive is not None and not is_alive():
            body = {"status": "unhealthy", "reason": "the engine thread has stopped"}
            return JSONResponse(body, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics_registry.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        if model_id != state.model_name and model_id not in state.aliases:
            raise APIError(404, f"model '{model_id}' does not exist", code="model_not_found")
        return JSONResponse(_model_card(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest, state.limits)
        model = state.resolve_model(req.model)
        prompt = completion_prompt(req)
        if isinstance(prompt, str):
            _check_prompt_size(state, len(prompt), "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream, _ = await _submit(state, prompt, req, max_tokens, rid)
        if req.stream:
            events = server_streams.completion_events(service, stream, model, req.include_usage)
            return StreamingResponse(_tracked(state, rid, events), media_type="text/event-stream")
        try:
            last = await server_streams.collect(service, stream, request)
        finally:
            state.inflight.discard(rid)
        n_out = len(last.token_ids)
        return JSONResponse(
            completion_response(
                stream.request_id,
                model,
                last.text,
                last.finish_reason,
                usage(len(last.prompt_token_ids), n_out),
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, state.limits)
        model = state.resolve_model(req.model)
        messages = chat_messages(req)
        _check_prompt_size(state, sum(len(m["content"]) for m in messages), "messages")
        sampling_params(req, 1)  # a bad parameter is a 400 before any tokenizing

        def template() -> list[int]:
            try:
                return service.apply_chat_template(messages)
            except ValueError as e:
                message = str(e)
                if not message.startswith("messages"):
                    message = f"messages: {message}"
                raise bad_request(message, param="messages") from None

        def max_tokens(prompt_ids: list[int]) -> int:
            if req.max_completion_tokens is not None:
                return req.max_completion_tokens
            if req.max_tokens is not None:
                return req.max_tokens
            # OpenAI: up to the context length, capped by the KV pool
            return service.engine.max_new_tokens(len(prompt_ids))

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream, _ = await _submit(state, template, req, max_tokens, rid)
        if req.stream:
            events = server_streams.chat_events(service, stream, model, req.include_usage)
            return StreamingResponse(_tracked(state, rid, events), media_type="text/event-stream")
        try:
            last = await server_streams.collect(service, stream, request)
        finally:
            state.inflight.discard(rid)
        return JSONResponse(
            chat_response(
                stream.request_id,
                model,
                last.text,
                last.finish_reason,
                usage(len(last.prompt_token_ids), len(last.token_ids)),
            )
        )


def _max_model_len(service: Any) -> int:
    """The context length the engine enforces (prompt + output tokens)."""
    resolved = getattr(service, "max_model_len", None) or service.config.max_model_len
    return int(resolved or DEFAULT_MAX_MODEL_LEN)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "inference-playground",
        "root": state.service.config.model,
        "max_model_len": _max_model_len(state.service),
    }


# --- running it ------------------------------------------------------------------------------


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for the request line and headers: uvicorn times
    out only idle keep-alive connections, so a client that opens a connection and sends
    nothing, or trickles its headers a byte at a time, would hold it forever (slowloris).
    The deadline runs from the connection's start (and from each response's end) until h11
    has a complete request head."""

    header_timeout_s = 10.0  # set per server by _protocol_class
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # before super(): it may start the next (pipelined) request
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
            self._cancel_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def _protocol_class(limits: HTTPLimits) -> type[H11Protocol]:
    return type("H11Protocol", (_H11Protocol,), {"header_timeout_s": limits.header_timeout_s})


def uvicorn_config(app: FastAPI, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings with this app's HTTP limits (timeouts, header size)."""
    limits: HTTPLimits = app.state.server.limits
    return uvicorn.Config(
        app,
        http=_protocol_class(limits),
        timeout_keep_alive=limits.keep_alive_timeout_s,
        # Request line + headers: at most 16 KiB (h11's default, said here on purpose).
        h11_max_incomplete_event_size=16 * 1024,
        timeout_graceful_shutdown=int(limits.drain_timeout_s) + 5,
        **kwargs,
    )


class _Server(uvicorn.Server):
    """uvicorn.Server that drains as docs/serving.md says: from the moment shutdown begins
    new requests are answered 503 (uvicorn alone would stop accepting connections at once),
    in-flight ones get drain_timeout_s to finish, and whatever is still running then is
    aborted so that it ends properly: a JSON 503, or an error event and [DONE] on a stream."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.limits.drain_timeout_s
        while state.inflight and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        for request_id in list(state.inflight):
            state.service.abort(request_id)
        deadline = loop.time() + 2.0  # their answers are one engine-thread pass away
        while state.inflight and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


class BackgroundServer:
    """The server on a background thread (tests, or the UI serving the API alongside).
    port 0 picks a free port; `url` says which."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn_config(app, log_level="warning")
        self.server = _Server(config, app.state.server)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()


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
        _Server(uv_config, app.state.server).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
