"""Remote mode against llama.cpp (issue 18): a stand-in server that behaves like `llama-server` on
the points that misled the playground (the model id is a GGUF path that does not exist here, no
max_model_len but meta.n_ctx_train and /props' per-slot n_ctx, a prompt cache that makes a
repeated prompt fast unless the request says cache_prompt: false), and the same checks against a
real llama-server when one is on the PATH."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from playground.context import AppContext
from playground.handlers.chat_remote import RemoteChat
from playground.handlers.compare_remote import same_server, targets_for
from playground.handlers.loadtest import spec_from_form
from playground.loadgen import OpenAITarget, WorkloadSpec, build_requests, run_load_test
from playground.remote import tokenizer as remote_tokenizer
from playground.remote.client import RemoteServer
from playground.remote.tokenizer import LazyTokenizer, TokenIdPrompts, resolve_prompt_tokenizer

MODEL_PATH = "/models/not-on-this-machine/SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX_SLOT = 2048
PREFILL_S = 0.4  # an uncached prompt's prefill in the stand-in; a cached one takes ~0


class LlamaCppStandIn:
    """What llama-server does on the points of issue 18, nothing more."""

    def __init__(self) -> None:
        self.cached: set[tuple] = set()  # prompts seen with cache_prompt on
        self.bodies: list[dict] = []  # every completion request, in arrival order
        self.evaluated: list[int] = []  # prompt tokens evaluated per request (its log)
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.get("/props")(self.props)
        self.app.post("/v1/completions")(self.completions)

    async def models(self) -> dict:
        meta = {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": 8192, "n_embd": 576}
        card = {"id": MODEL_PATH, "object": "model", "owned_by": "llamacpp", "meta": meta}
        return {"object": "list", "data": [card]}

    async def props(self) -> dict:
        return {"default_generation_settings": {"n_ctx": N_CTX_SLOT}, "total_slots": 1}

    async def completions(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        key = tuple(prompt) if isinstance(prompt, list) else (prompt,)
        use_cache = body.get("cache_prompt", True)  # llama.cpp's default is on
        hit = use_cache and key in self.cached
        if use_cache:
            self.cached.add(key)
        num_prompt = len(key)
        self.evaluated.append(1 if hit else num_prompt)  # a hit re-evaluates the last token
        num_out = int(body.get("max_tokens", 4))

        async def events() -> Iterator[str]:
            await asyncio.sleep(0.0 if hit else PREFILL_S)
            for _ in range(num_out):
                chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": " x"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_out}
            end = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            yield f"data: {json.dumps({**end, 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def llama() -> Iterator[tuple[LlamaCppStandIn, str]]:
    stand_in = LlamaCppStandIn()
    port = _free_port()
    config = uvicorn.Config(stand_in.app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):  # bounded: 10 s
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the stand-in did not start"
    yield stand_in, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


SPEC = WorkloadSpec(num_prompts=4, input_len=24, output_len=3, seed=5)


def _run(target: OpenAITarget, requests=None):
    return asyncio.run(run_load_test(SPEC, target, requests=requests))


def test_connect_reads_llamacpp_context_and_kind(llama):
    _, url = llama
    remote = RemoteServer.connect(url)
    assert remote.model == MODEL_PATH and remote.kind == "llama.cpp"
    assert remote.max_model_len == N_CTX_SLOT and "n_ctx" in remote.context_source
    assert remote.vocab_size == 49152 and "cache_prompt: false" in remote.cache_note
    # The load-test form checks lengths against what the server reported.
    too_long = {"input_kind": "fixed", "input_mean": 2040, "output_kind": "fixed"}
    with pytest.raises(ValueError, match="max_model_len 2048"):
        spec_from_form(too_long, remote.max_model_len)


def test_tokenizer_chain_never_touches_the_network(llama, monkeypatch):
    """The served id is a path that is not here: the embedded tokenizer, and no connection
    attempt to anything but loopback."""
    _, url = llama
    remote = RemoteServer.connect(url)
    attempts = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError("offline by design")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    lazy = LazyTokenizer.for_remote(remote)
    started = time.monotonic()
    source = lazy.source
    assert time.monotonic() - started < 30 and attempts == []
    assert source.startswith("the embedded model's tokenizer") and "no such folder" in source
    assert lazy.get().vocab_size == 49152
    hub = resolve_prompt_tokenizer("some-org/not-cached-anywhere", None)
    assert "not in the local Hugging Face cache" in hub.source and attempts == []


def test_without_any_tokenizer_prompts_are_token_ids(llama, monkeypatch):
    stand_in, url = llama
    remote = RemoteServer.connect(url)

    def no_tokenizer(name):
        raise ValueError(f"{name!r}: unavailable in this test")

    monkeypatch.setattr(remote_tokenizer, "tokenizer_from_name", no_tokenizer)
    prompts = LazyTokenizer.for_remote(remote).resolve()
    assert isinstance(prompts.tokenizer, TokenIdPrompts)
    assert prompts.source.startswith("no tokenizer: token ids 1000..49151")
    result = _run(OpenAITarget.for_server(remote, prompts))
    assert result.summary()["completed"] == SPEC.num_prompts
    assert result.notes["prompts"] == prompts.source  # the results say what built the prompts
    for body in stand_in.bodies:
        assert len(body["prompt"]) == 24 and all(1000 <= i < 49152 for i in body["prompt"])


def test_load_test_turns_llamacpp_prompt_cache_off(llama):
    """A rerun of a seeded load test is not served from the first run's cache: every request
    says cache_prompt: false. With the cache on (the server's default), the stand-in shows the
    skew of issue 18: the second run evaluates 1 token per prompt and its TTFT collapses."""
    stand_in, url = llama
    remote = RemoteServer.connect(url)
    prompts = LazyTokenizer.for_remote(remote).resolve()
    _run(OpenAITarget.for_server(remote, prompts))
    second = _run(OpenAITarget.for_server(remote, prompts))
    assert all(b["cache_prompt"] is False for b in stand_in.bodies)
    assert stand_in.evaluated == [24] * 8
    assert min(r.ttft_s for r in second.per_request) >= PREFILL_S  # every prompt prefilled
    assert "cache_prompt: false" in second.notes["caching"]

    stand_in.bodies.clear()
    stand_in.evaluated.clear()
    _run(OpenAITarget.for_server(remote, prompts, prompt_cache=True))
    cached = _run(OpenAITarget.for_server(remote, prompts, prompt_cache=True))
    assert "cache_prompt" not in stand_in.bodies[0] and stand_in.evaluated[4:] == [1] * 4
    skew_ms = second.summary()["mean_ttft_ms"] - cached.summary()["mean_ttft_ms"]
    assert skew_ms > 0.6 * PREFILL_S * 1000  # the cache hides the prefill
    assert "on" in cached.notes["caching"]


def test_compare_on_one_server_salts_the_second_side(llama):
    """B re-sends A's prompts to the same server: B's are salted (a different first token,
    lengths unchanged), so even a cache the client cannot turn off gives B no hit."""
    stand_in, url = llama
    a = RemoteServer.connect(url)
    b = RemoteServer.connect(url.replace("127.0.0.1", "localhost") + "/v1")
    assert same_server(a, b)
    prompts = LazyTokenizer.for_remote(a).resolve()
    requests = build_requests(SPEC, prompts.tokenizer)
    target_a, target_b, warning = targets_for(a, b, prompts, requests)
    assert "Same server on both sides" in warning and "salted" in warning
    # As a server whose cache is a server flag would: keep llama.cpp's cache on for both.
    target_a.prompt_cache = target_b.prompt_cache = True
    _run(target_a, requests)
    _run(target_b, requests)
    assert stand_in.evaluated == [24] * 8  # no prompt of B was found cached
    sent_a, sent_b = stand_in.bodies[:4], stand_in.bodies[4:]
    tails_a = {tuple(x["prompt"][1:]): x["prompt"][0] for x in sent_a}
    for y in sent_b:  # the same prompt but its first token, so the same length
        assert tails_a[tuple(y["prompt"][1:])] != y["prompt"][0] == target_b.salt_token_id
    assert "salt" in target_b.notes and "salt" not in target_a.notes
    other = RemoteServer("http://127.0.0.1:1", "m", kind="vllm")
    _, plain_b, no_warning = targets_for(a, other, prompts, requests)
    assert no_warning == "" and plain_b.salt_token_id is None
    assert "server flag" in plain_b.notes["caching"]


def test_load_test_tab_target_and_stop_message(llama):
    _, url = llama
    remote = RemoteServer.connect(url)
    ctx = AppContext.for_remote(remote)
    assert ctx.max_model_len == N_CTX_SLOT
    target = ctx.load_test_target()
    request = build_requests(SPEC, target.tokenizer)[0]
    assert target.payload(request, SPEC)["cache_prompt"] is False
    assert "llama.cpp" in RemoteChat(remote).stopped_message(None)


LLAMA_SERVER = shutil.which("llama-server")


@pytest.mark.skipif(LLAMA_SERVER is None, reason="no llama-server binary on the PATH")
def test_against_a_real_llama_server():
    from engine.tokenizer import embedded_gguf_path

    port = _free_port()
    cmd = [LLAMA_SERVER, "-m", str(embedded_gguf_path()), "--port", str(port), "-c", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        remote = None
        for _ in range(240):  # bounded: 120 s for the model to load
            try:
                remote = RemoteServer.connect(url)
                break
            except ValueError:
                time.sleep(0.5)
        assert remote is not None, "llama-server did not answer"
        assert remote.kind == "llama.cpp" and remote.max_model_len
        prompts = LazyTokenizer.for_remote(remote).resolve()
        result = _run(OpenAITarget.for_server(remote, prompts))
        assert result.summary()["completed"] == SPEC.num_prompts
        assert "cache_prompt: false" in result.notes["caching"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
