"""A small client for a remote OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp): what the
playground's remote mode needs, with every latency measured here, by the client.

    remote = RemoteServer.connect("http://host:8000")    # GET /v1/models: model, max_model_len
    stream = ChatStream(remote, chat_body(remote.model, messages, params))
    async for update in stream.updates(): ...            # ChatUpdate: the reply so far
    stream.stop()                                        # from any thread: closes the stream

A remote server exposes no engine telemetry (block map, step stats, queue times), so nothing here
pretends to: TTFT is send -> first content chunk as this client saw it, network included.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from engine.request import SamplingParams
from playground.loadgen.workload import Tokenizer

CONNECT_TIMEOUT_S = 10.0
CHAT_TIMEOUT_S = 3600.0  # one reply; a stalled server is stopped with Stop


def api_url(base_url: str, path: str) -> str:
    """{base}/v1/{path}; accepts "http://host:port" and the OpenAI client's ".../v1"."""
    base = base_url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


def error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


@dataclass(frozen=True)
class RemoteServer:
    base_url: str  # as given, without a trailing slash
    model: str  # what requests send as "model"
    api_key: str | None = None
    max_model_len: int | None = None  # tokens, when /v1/models reports it (vLLM, SGLang, ours)
    tokenizer_name: str | None = None  # builds load-test prompts (None: the model id)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def label(self) -> str:
        return f"{self.model} at {self.base_url}"

    @classmethod
    def connect(
        cls,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        tokenizer_name: str | None = None,
    ) -> RemoteServer:
        """Asks GET /v1/models which model is served (model=None: the first listed) and its
        max_model_len. ValueError says what went wrong, for the command line or the UI."""
        base_url = (base_url or "").strip().rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL: expected http://host:port, got {base_url!r}")
        server = cls(base_url, model or "", api_key or None, None, tokenizer_name or None)
        url = api_url(base_url, "models")
        try:
            resp = httpx.get(url, headers=server.headers, timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise ValueError(f"base URL: no OpenAI server answers at {url} ({e})") from None
        if resp.status_code != 200:
            msg = error_message(resp.text)
            raise ValueError(f"base URL: GET {url} answered HTTP {resp.status_code}: {msg}")
        try:
            cards = [c for c in resp.json()["data"] if isinstance(c, dict) and "id" in c]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"base URL: GET {url} is not an OpenAI model list") from None
        card = next((c for c in cards if c["id"] == model), None) if model else None
        if card is None and not model:
            if not cards:
                raise ValueError(f"base URL: {url} lists no model; pass the model's name")
            card = cards[0]
        length = (card or {}).get("max_model_len")
        return replace(
            server,
            model=model or card["id"],
            max_model_len=int(length) if isinstance(length, int) and length > 0 else None,
        )


class LazyTokenizer:
    """The tokenizer that builds load-test prompts, loaded on first use (not at start-up) and
    kept: an engine model spec (smollm2-135m, a folder, a GGUF) or a Hugging Face name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokenizer: Tokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> Tokenizer:
        with self._lock:
            if self._tokenizer is None:
                from playground.loadgen import load_tokenizer

                try:
                    tokenizer = load_tokenizer(self.name)
                except Exception as e:  # not installed, not downloadable, not a tokenizer
                    tokenizer, why = None, f"{type(e).__name__}: {e}"
                else:
                    why = "it ships no tokenizer"
                if tokenizer is None:
                    raise ValueError(
                        f"tokenizer: could not load {self.name!r} ({why}); start the playground "
                        "with --tokenizer and the served model's HF folder or engine model spec"
                    )
                self._tokenizer = tokenizer
            return self._tokenizer


def chat_body(model: str, messages: list[dict], params: SamplingParams) -> dict[str, Any]:
    """A streaming chat request with the form's sampling fields; top_k is a vLLM extension
    (SGLang, llama.cpp and ours accept it too) and is left out when off."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.top_k != -1:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    return body


@dataclass(frozen=True)
class ClientMetrics:
    """One reply as this client timed it (time.perf_counter, seconds)."""

    ttft_s: float | None  # send -> first chunk with content
    e2e_s: float  # send -> end of the stream
    num_tokens: int  # completion tokens: the server's usage, else content chunks
    tokens_from_usage: bool  # False: counted chunks (a chunk may hold several tokens)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (tokens - 1), as loadgen and `vllm bench serve` define it."""
        if self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)


@dataclass(frozen=True)
class ChatUpdate:
    request_id: str | None  # the server's id for the completion, once a chunk named it
    text: str  # the reply so far
    num_chunks: int  # content chunks received so far
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" (stopped here) | None
    error: str | None = None
    metrics: ClientMetrics | None = None  # on the finished update


class ChatStream:
    """One streaming POST /v1/chat/completions. The HTTP read runs in its own task, so stop()
    closes the connection even while the server is silent (queued, or in a long prefill); a
    server that aborts on disconnect (ours, vLLM, SGLang) then frees the request's KV blocks."""

    def __init__(self, remote: RemoteServer, body: dict[str, Any]) -> None:
        self.remote = remote
        self.body = body
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stop_requested = False

    def stop(self) -> None:
        """Safe from any thread; the last update then has finish_reason "abort"."""
        self._stop_requested = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)

    async def updates(self) -> AsyncIterator[ChatUpdate]:
        """The reply so far, newest only (updates that piled up are merged); the last one is
        finished. Leaving early closes the stream."""
        queue: asyncio.Queue[ChatUpdate] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(self._read(queue))
        if self._stop_requested:
            self._task.cancel()
        try:
            while True:
                update = await queue.get()
                while not update.finished and not queue.empty():
                    update = queue.get_nowait()
                yield update
                if update.finished:
                    return
        finally:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _read(self, queue: asyncio.Queue[ChatUpdate]) -> None:
        reply = _Reply(send_time=time.perf_counter())
        url = api_url(self.remote.base_url, "chat/completions")
        timeout = httpx.Timeout(CHAT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        try:
            async with (
                httpx.AsyncClient(headers=self.remote.headers, timeout=timeout) as client,
                client.stream("POST", url, json=self.body) as resp,
            ):
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    reply.error = f"HTTP {resp.status_code}: {error_message(body)}"
                else:
                    async for chunk in _sse_chunks(resp):
                        if reply.add(chunk, time.perf_counter()):
                            queue.put_nowait(reply.update())
                        if reply.error:
                            break
        except asyncio.CancelledError:  # stop(), or the consumer left: the connection is closed
            reply.finish_reason = "abort"
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            reply.error = f"{type(e).__name__}: {e}"
        queue.put_nowait(reply.final(time.perf_counter()))


@dataclass
class _Reply:
    """What the chunks of one reply said so far."""

    send_time: float
    first_content_time: float | None = None
    request_id: str | None = None
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None

    def add(self, chunk: dict, now: float) -> bool:
        """Takes one chunk; True when it carried content."""
        if chunk.get("error"):
            self.error = f"stream error: {error_message(json.dumps(chunk))}"
            return False
        self.request_id = chunk.get("id") or self.request_id
        choices = chunk.get("choices") or []
        choice = choices[0] if choices else {}
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.usage = chunk.get("usage") or self.usage
        content = (choice.get("delta") or {}).get("content")
        if not content:
            return False
        if self.first_content_time is None:
            self.first_content_time = now
        self.parts.append(content)
        return True

    def update(self) -> ChatUpdate:
        return ChatUpdate(self.request_id, "".join(self.parts), len(self.parts))

    def final(self, end_time: float) -> ChatUpdate:
        tokens = (self.usage or {}).get("completion_tokens")
        ttft = self.first_content_time
        metrics = ClientMetrics(
            ttft_s=None if ttft is None else ttft - self.send_time,
            e2e_s=end_time - self.send_time,
            num_tokens=int(tokens) if tokens is not None else len(self.parts),
            tokens_from_usage=tokens is not None,
        )
        return ChatUpdate(
            self.request_id,
            "".join(self.parts),
            len(self.parts),
            finished=True,
            finish_reason=self.finish_reason,
            error=self.error,
            metrics=metrics,
        )


async def _sse_chunks(resp: httpx.Response) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    async for line in resp.aiter_lines():
        data = line[5:].strip() if line.startswith("data:") else ""
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)
