"""Chat with the in-process engine: its chat template, its stream, its own per-request metrics
(TTFT from arrival in the engine). The ChatBackend of local mode."""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.request import RequestOutput, SamplingParams
from engine.serving.logprobs_format import TokenTexts
from playground.engine_client import EngineClient
from playground.handlers.chat import (
    NOTHING_TO_STOP,
    ActiveRequests,
    ChatReply,
    StreamThrottle,
    stats_line,
)
from playground.handlers.token_probs import TokensSoFar, probability_stats


def prompt_for(service: EngineClient, messages: list[dict]) -> list[int] | str:
    """Token ids from the model's chat template, or plain "role: text" lines without one."""
    try:
        return service.apply_chat_template(messages)
    except ValueError:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])


async def stream_replies(
    service: EngineClient,
    prompt: list[int] | str,
    params: SamplingParams,
    active: ActiveRequests[str],
    session: str,
) -> AsyncIterator[list[RequestOutput]]:
    """The latest output of each of the request's n sequences (by index), throttled; the
    last update (every sequence over) is always yielded. Aborts the request if the consumer
    goes away before it finishes."""
    stream = service.submit(prompt, params)
    active.set(session, stream.request_id)
    throttle = StreamThrottle()
    latest: dict[int, RequestOutput] = {}
    finished = False
    try:
        async for out in stream:
            latest[out.index] = out  # each output carries its sequence's text so far
            finished = out.request_finished
            if throttle.due(finished):
                yield [latest[i] for i in sorted(latest)]
    finally:
        active.clear(session, stream.request_id)
        if not finished:
            service.abort(stream.request_id)


async def stream_reply(
    service: EngineClient,
    prompt: list[int] | str,
    params: SamplingParams,
    active: ActiveRequests[str],
    session: str,
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for a one-sequence reply (n = 1), throttled (the last one is
    always yielded)."""
    async for outputs in stream_replies(service, prompt, params, active, session):
        yield outputs[0]


def engine_stats_line(config: EngineConfig, out: RequestOutput) -> str:
    """A finished reply's stats line, with what the engine knows of its prompt (the prefix
    cache's share, when caching is on) and of its drafts (when speculative decoding is on)."""
    m = out.metrics
    return stats_line(
        m,
        len(out.token_ids),
        out.finish_reason,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=m.num_cached_tokens if config.enable_prefix_caching else None,
        accepted_drafts=m.num_accepted_draft_tokens if config.speculative_method != "off" else None,
    )


class EngineChat:
    """Chat with the in-process engine; the Stop button aborts the request by its id, and the
    engine frees its KV blocks at once."""

    waiting = "waiting for the engine"
    error_label = "Engine error"

    def __init__(self, service: EngineClient, active: ActiveRequests[str] | None = None) -> None:
        self.service = service
        self.active = active if active is not None else ActiveRequests[str]()

    async def replies(
        self, messages: list[dict], params: SamplingParams, session: str
    ) -> AsyncIterator[ChatReply]:
        """With n > 1 the reply is sequence 0 (it continues the conversation) and the others
        come as alternatives, shown beside it."""
        prompt = prompt_for(self.service, messages)
        texts = TokenTexts(self.service.tokenizer) if params.logprobs is not None else None
        so_far: dict[int, TokensSoFar] = {}  # per sequence index
        async for outs in stream_replies(self.service, prompt, params, self.active, session):
            # request_finished marks the request's last delta, whichever sequence ended last.
            out, finished = outs[0], any(o.request_finished for o in outs)
            n = sum(len(o.token_ids) for o in outs)
            tokens = ()
            if texts:
                tokens = tuple(
                    so_far.setdefault(o.index, TokensSoFar()).from_engine(
                        texts, o.logprobs, o.metrics.token_drafted
                    )
                    for o in outs
                )
            stats = ""
            if finished:
                stats = engine_stats_line(self.service.config, out)
                stats += probability_stats(tokens[0]) if tokens else ""
            yield ChatReply(
                out.request_id,
                out.text,
                f"{n} tokens" if len(outs) == 1 else f"{n} tokens in {len(outs)} replies",
                finished,
                any(o.finish_reason == "abort" for o in outs),
                next((o.error for o in outs if o.error), None),
                stats,
                alternatives=tuple(o.text for o in outs[1:]),
                tokens=tokens,
            )

    def streaming(self, session: str) -> bool:
        return self.active.get(session) is not None

    def stopped_message(self, request_id: str | None) -> str:
        return f"Stopped {request_id}: the engine freed its KV blocks at once."

    def stop(self, session: str) -> str:
        request_id = self.active.get(session)
        if request_id is None:
            return NOTHING_TO_STOP
        self.service.abort(request_id)
        return self.stopped_message(request_id)
