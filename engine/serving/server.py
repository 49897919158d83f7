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
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    usage,
)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServerState:
    service: Any  # EngineService
    model_name: str  # the name clients send as "model" and see in /v1/models
    aliases: frozenset[str]  # other names accepted as "model" (e.g. the engine's model spec)
    api_key: str | None = None
    draining: bool = False  # shutting down: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))

    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested == self.model_name or requested in self.aliases:
            return self.model_name
        raise bad_request(
            f"model: '{requested}' is not served here (served: '{self.model_name}')",
            param="model",
            code="model_not_found",
        )


def create_app(
    service: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_service: bool = False,
) -> FastAPI:
    """The ASGI app. With shutdown_service the service is shut down with the app."""
    model_name = served_model_name or service.model_name
    state = ServerState(
        service=service,
        model_name=model_name,
        aliases=frozenset({service.model_name, service.config.model}) - {model_name},
        api_key=api_key,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.draining = True
        if shutdown_service:
            await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="inference-playground", lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _json_error(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status_code == 401 else None
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return _json_error(err)

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


def _check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), state.api_key):
        raise APIError(
            401,
            "Incorrect or missing API key (Authorization: Bearer <key>)",
            code="invalid_api_key",
        )


def _check_serving(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is shutting down", type="service_unavailable")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _add_routes(app: FastAPI, state: ServerState) -> None:
    service = state.service

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics_registry.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        _check_auth(state, request)
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        _check_auth(state, request)
        if model_id != state.model_name and model_id not in state.aliases:
            raise APIError(404, f"model '{model_id}' does not exist", code="model_not_found")
        return JSONResponse(_model_card(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(state, request)
        _check_serving(state)
        req: CompletionRequest = await _parse(request, CompletionRequest)
        model = state.resolve_model(req.model)
        prompt = completion_prompt(req)
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens)
        stream = server_streams.submit(service, prompt, params, f"cmpl-{uuid.uuid4().hex}")
        if req.stream:
            events = server_streams.completion_events(service, stream, model, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        last = await server_streams.collect(service, stream, request)
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
        _check_auth(state, request)
        _check_serving(state)
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        model = state.resolve_model(req.model)
        messages = chat_messages(req)
        try:
            prompt_ids = service.apply_chat_template(messages)
        except ValueError as e:
            raise bad_request(f"messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length, capped by the KV pool
            max_tokens = service.engine.max_new_tokens(len(prompt_ids))
        params = sampling_params(req, max_tokens)
        stream = server_streams.submit(service, prompt_ids, params, f"chatcmpl-{uuid.uuid4().hex}")
        if req.stream:
            events = server_streams.chat_events(service, stream, model, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        last = await server_streams.collect(service, stream, request)
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


class _Server(uvicorn.Server):
    """uvicorn.Server that answers 503 from the moment shutdown begins (while in-flight
    requests drain), not only once the app's lifespan ends."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.draining = True
        await super().shutdown(sockets)


class BackgroundServer:
    """The server on a background thread (tests, or the UI serving the API alongside).
    port 0 picks a free port; `url` says which."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
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
    )
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    # uvicorn shuts down cleanly on Ctrl+C, then re-raises the signal: that is a normal exit.
    with contextlib.suppress(KeyboardInterrupt):
        _Server(uv_config, app.state.server).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
