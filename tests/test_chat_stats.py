"""The chat stats line says what TTFT and TPOT depend on: the prompt's length and the prefix
cache's share of it (the engine's own count, or a server's usage.prompt_tokens_details, which
our server now fills), and how many output tokens were accepted speculative drafts."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from engine import EngineConfig, EngineService
from engine.serving.http_server import BackgroundServer
from engine.serving.server import create_app
from playground.handlers.chat import sampling_params
from playground.handlers.chat_engine import EngineChat
from playground.handlers.chat_remote import RemoteChat
from playground.remote.client import RemoteServer

CONFIG = dict(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=64,
              enable_prefix_caching=True, speculative_method="ngram")  # fmt: skip
# Long enough to fill whole 16-token blocks, which are what the prefix cache keeps.
MESSAGES = [{"role": "user", "content": "Tell me about the sea. " * 8}]


@pytest.fixture(scope="module")
def service():
    svc = EngineService(EngineConfig(**CONFIG))
    yield svc
    svc.shutdown()


def _last(backend, params):
    async def chat():
        return [r async for r in backend.replies(MESSAGES, params, "s")][-1]

    return asyncio.run(chat())


def _cacheable(prompt_tokens: int) -> int:
    """What a repeated prompt finds in the cache: its full 16-token blocks, less the last one
    when the prompt fills it exactly (its last token must run for the first output's logits)."""
    return (prompt_tokens - 1) // 16 * 16


def _prompt_part(stats: str) -> tuple[int, int]:
    prompt, cached = re.search(r"TTFT \d+ ms \(prompt (\d+) tokens, (\d+) cached\)", stats).groups()
    return int(prompt), int(cached)


def test_engine_chat_names_the_prompt_its_cached_part_and_the_accepted_drafts(service):
    params = sampling_params(0.0, 1.0, -1, 24, -1)
    first, again = _last(EngineChat(service), params), _last(EngineChat(service), params)
    prompt = len(service.apply_chat_template(MESSAGES))
    assert _prompt_part(first.stats) == (prompt, 0)
    prompt_again, cached = _prompt_part(again.stats)  # the same prompt: its full blocks hit
    assert prompt_again == prompt and cached == _cacheable(prompt)
    drafts = re.search(r"TPOT \d+ ms \((\d+) of 24 tokens from accepted drafts\)", again.stats)
    assert drafts is not None, again.stats


def test_the_token_view_marks_the_same_tokens_the_count_counts(service):
    """With token probabilities on, the accepted drafts the stats line counts are the tokens
    the view underlines (RequestMetrics.token_drafted, one flag per output token)."""
    params = sampling_params(0.0, 1.0, -1, 48, -1, token_probs=True)
    last = _last(EngineChat(service), params)
    count = int(re.search(r"\((\d+) of 48 tokens from accepted drafts\)", last.stats)[1])
    assert count > 0, "no draft accepted: the test cannot tell"  # the random model loops
    assert sum(t.drafted for t in last.tokens[0]) == count
    assert not last.tokens[0][0].drafted  # the first token comes from the prefill, never a draft


def test_without_caching_and_drafts_the_line_says_neither():
    svc = EngineService(EngineConfig(model="random:tiny", dtype="float32", max_model_len=256,
                                     num_kv_blocks=64))  # fmt: skip
    try:
        stats = _last(EngineChat(svc), sampling_params(0.0, 1.0, -1, 8, -1)).stats
    finally:
        svc.shutdown()
    assert re.search(r"TTFT \d+ ms \(prompt \d+ tokens\) · TPOT \d+ ms · ", stats), stats


def test_server_usage_reports_cached_tokens_and_the_remote_chat_shows_them(service):
    server = BackgroundServer(create_app(service), port=0).start()
    try:
        remote = RemoteServer.connect(server.url)
        params = sampling_params(0.0, 1.0, -1, 8, -1)
        _last(EngineChat(service), params)  # the prompt's blocks are in the cache now
        over_http = _last(RemoteChat(remote), params)
        body = {"model": remote.model, "messages": MESSAGES, "max_tokens": 4}
        plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    finally:
        server.stop()
    prompt = len(service.apply_chat_template(MESSAGES))
    assert _prompt_part(over_http.stats) == (prompt, _cacheable(prompt))
    assert "accepted drafts" not in over_http.stats  # the OpenAI API does not report them
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": _cacheable(prompt)}
