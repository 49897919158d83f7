"""Relaying one engine request over HTTP: submit it, then either collect its final output or
turn its RequestOutput deltas into OpenAI server-sent events. Whatever ends the relay early (a
client disconnect cancels the handler or the event generator) aborts the request, which frees
its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request

from engine.serving.logprobs_format import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    next_text_offset,
)
from engine.serving.protocol import (
    SSE_DONE,
    APIError,
    bad_request,
    chat_chunk,
    completion_chunk,
    error_body,
    field_of,
    sse,
    usage,
    usage_chunk,
)


def submit(service: Any, prompt: str | list[int], params: Any, request_id: str) -> Any:
    try:
        return service.submit(prompt, params, request_id=request_id)
    except ValueError as e:  # empty / too long prompt, never fits the KV cache, ...
        message = str(e)
        raise bad_request(message, param=field_of(message) or "prompt") from None
    except RuntimeError as e:  # the engine is shutting down
        raise APIError(503, str(e), type="service_unavailable") from None


async def collect(service: Any, stream: Any, request: Request) -> list[Any]:
    """The final RequestOutput of each of the request's n sequences, by index; aborts the
    request if the client disconnects first."""

    async def drain() -> list[Any]:
        finals: dict[int, Any] = {}
        async for out in stream:
            if out.finished or out.error:
                finals[out.index] = out
        return [finals[i] for i in sorted(finals)]

    async def disconnected() -> None:
        # The body has been read: the next ASGI message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # client gone (or this handler cancelled): free the blocks
            service.abort(stream.request_id)
            work.cancel()
    if not work.done() or work.cancelled():
        # The client is gone: nobody reads this answer (and work.result() of a task just
        # cancelled would raise InvalidStateError). 499 is nginx's "client closed request".
        raise APIError(499, "the client closed the request", code="client_closed_request")
    finals = work.result()
    if not getattr(service, "is_running", True):
        raise APIError(503, "the server is shutting down", type="service_unavailable")
    failed = [out.error for out in finals if out.error]
    if not finals or failed:
        detail = failed[0] if failed else "no output"
        raise APIError(500, f"the engine failed the request: {detail}", type="internal_error")
    if any(out.finish_reason == "abort" for out in finals):
        raise APIError(503, "the request was aborted (server shutting down?)", type="aborted")
    return finals


async def _relay(service: Any, stream: Any) -> AsyncIterator[Any]:
    """The stream's deltas; aborts the request when the consumer stops early (disconnect)."""
    finished = False
    try:
        async for out in stream:
            finished = out.request_finished  # every one of the n sequences is over
            yield out
    finally:
        if not finished:
            service.abort(stream.request_id)


def _stream_error(out: Any) -> str:
    """The error event of a stream the server ended: the engine failed or shut down, or the
    request was aborted (only the server aborts a stream whose client still reads it: when
    shutdown's drain time is over). The client then gets [DONE], as after any stream."""
    if out.error:
        body = error_body(f"the engine failed the request: {out.error}", type="internal_error")
    else:
        body = error_body(
            "the request was aborted: the server is shutting down", type="service_unavailable"
        )
    return sse(body)


def prompt_text(service: Any, out: Any) -> str:
    """The prompt as text (for echo): as sent, or the decode of a token-id prompt."""
    if out.prompt is not None:
        return out.prompt
    tokenizer = service.tokenizer
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def completion_events(
    service: Any, stream: Any, model: str, include_usage: bool, *, echo: bool = False,
    with_logprobs: bool = False,
) -> AsyncIterator[str]:  # fmt: skip
    """Completion chunks; with echo the first one leads with the prompt (and, with logprobs,
    the prompt tokens' logprobs); each chunk carries the logprobs of the tokens it adds, with
    text offsets running on across chunks."""
    rid = stream.request_id
    texts = TokenTexts(service.tokenizer)
    offsets: dict[int, int] = {}  # per choice index: the next token's text offset

    def chunk_for(out: Any) -> dict[str, Any] | None:
        text, token_ids, scored = out.new_text, out.new_token_ids, out.new_logprobs or []
        if out.index not in offsets and echo:  # this choice's first chunk
            text = prompt_text(service, out) + text
            token_ids = out.prompt_token_ids + token_ids
            scored = (out.prompt_logprobs or []) + scored
        offset = offsets.setdefault(out.index, 0)
        logprobs = None
        if with_logprobs:
            logprobs = completion_logprobs(token_ids, scored, texts, offset)
            offsets[out.index] = next_text_offset(logprobs, offset)
        if not (text or out.finished or (with_logprobs and token_ids)):
            return None
        return completion_chunk(rid, model, text, out.finish_reason, logprobs, out.index)

    return _events(
        service, stream, model, include_usage, "text_completion", chunk_for
    )  # fmt: skip


def chat_events(
    service: Any, stream: Any, model: str, include_usage: bool, *, with_logprobs: bool = False,
    n: int = 1,
) -> AsyncIterator[str]:  # fmt: skip
    """Chat chunks; with logprobs each carries its new tokens' entries, so a token whose text
    is held back (a possible stop string, an unfinished character) still sends its logprob."""
    rid = stream.request_id
    texts = TokenTexts(service.tokenizer)

    def chunk_for(out: Any) -> dict[str, Any] | None:
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = None
        if with_logprobs:
            logprobs = chat_logprobs(out.new_logprobs or [], texts)
        if not (out.new_text or out.finished or (with_logprobs and out.new_token_ids)):
            return None
        return chat_chunk(rid, model, delta, out.finish_reason, logprobs, out.index)

    first = [chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, index=i)
             for i in range(n)]  # fmt: skip
    return _events(service, stream, model, include_usage, "chat.completion.chunk", chunk_for, first)


async def _events(
    service: Any,
    stream: Any,
    model: str,
    include_usage: bool,
    usage_object: str,
    chunk_for: Callable[[Any], dict[str, Any] | None],
    first: Sequence[dict[str, Any]] = (),  # chunks sent before any output (chat's roles)
) -> AsyncIterator[str]:
    """SSE events of one request: a chunk per delta that `chunk_for` makes one of (text,
    logprobs, or the final one), then the
    usage chunk when asked for, then [DONE]. With include_usage every chunk carries
    "usage": null, as OpenAI's stream does."""

    def event(chunk: dict[str, Any]) -> str:
        if include_usage:
            chunk["usage"] = None
        return sse(chunk)

    for chunk in first:
        yield event(chunk)
    last: dict[int, Any] = {}  # per choice index, its latest output
    async for out in _relay(service, stream):
        if out.error or out.finish_reason == "abort":
            yield _stream_error(out)
            yield SSE_DONE
            return
        last[out.index] = out
        chunk = chunk_for(out)
        if chunk is not None:
            yield event(chunk)
    if include_usage and last:
        yield sse(usage_chunk(stream.request_id, model, usage_object, usage(list(last.values()))))
    yield SSE_DONE
