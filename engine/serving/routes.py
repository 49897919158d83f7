"""The OpenAI routes: GET /health, /metrics, /v1/models[/{id}]; POST /v1/completions and
/v1/chat/completions. Handlers parse and check a request, tokenize it off the event loop,
submit it to the service, and relay its RequestOutput deltas (streams.py) as JSON or SSE; a
request stays in ServerState.inflight until its answer ends, so a shutdown can drain it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.serving import streams as server_streams
from engine.serving.http_limits import HTTPLimits, read_body
from engine.serving.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
from engine.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_choice,
    chat_messages,
    chat_response,
    completion_choice,
    completion_prompt,
    completion_response,
    from_validation_error,
    sampling_params,
    unencodable_string,
    usage,
)
from engine.serving.server_state import ServerState, max_model_len

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def _parse(request: Request, model: type[BaseModel], limits: HTTPLimits) -> Any:
    body = await read_body(request, limits)
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


def add_routes(app: FastAPI, state: ServerState) -> None:
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
            events = server_streams.completion_events(
                service, stream, model, req.include_usage, echo=req.echo,
                with_logprobs=req.logprobs is not None,
            )  # fmt: skip
            return StreamingResponse(_tracked(state, rid, events), media_type="text/event-stream")
        try:
            finals = await server_streams.collect(service, stream, request)
        finally:
            state.inflight.discard(rid)
        texts = TokenTexts(service.tokenizer)
        choices = [_completion_choice(service, req, out, texts) for out in finals]
        return JSONResponse(
            completion_response(
                stream.request_id,
                model,
                choices,
                usage(finals),
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
            events = server_streams.chat_events(
                service, stream, model, req.include_usage, with_logprobs=req.logprobs, n=req.n
            )
            return StreamingResponse(_tracked(state, rid, events), media_type="text/event-stream")
        try:
            finals = await server_streams.collect(service, stream, request)
        finally:
            state.inflight.discard(rid)
        texts = TokenTexts(service.tokenizer)
        choices = [
            chat_choice(out.index, out.text, out.finish_reason,
                        chat_logprobs(out.logprobs or [], texts) if req.logprobs else None)
            for out in finals
        ]  # fmt: skip
        return JSONResponse(
            chat_response(
                stream.request_id,
                model,
                choices,
                usage(finals),
            )
        )


def _completion_choice(service: Any, req: CompletionRequest, out: Any, texts: TokenTexts) -> dict:
    """One choice of a completion: with echo the prompt leads its text and scored tokens."""
    text, token_ids, scored = out.text, out.token_ids, out.logprobs
    if req.echo:
        text = server_streams.prompt_text(service, out) + text
        token_ids = out.prompt_token_ids + token_ids
        scored = (out.prompt_logprobs or []) + (scored or [])
    logprobs = completion_logprobs(token_ids, scored, texts) if req.logprobs is not None else None
    return completion_choice(out.index, text, out.finish_reason, logprobs)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "inference-playground",
        "root": state.service.config.model,
        "max_model_len": max_model_len(state.service),
    }
