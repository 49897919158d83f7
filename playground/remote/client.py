"""The one OpenAI HTTP client of the playground: remote chat, remote compare and the load
generator's OpenAITarget all talk to a server (ours, vLLM, SGLang, llama.cpp) through it.

    remote = RemoteServer.connect("http://host:8000")    # GET /v1/models: model, max_model_len
    client = OpenAIClient(remote.base_url, remote.api_key)
    reply = StreamReply(send_time=time.perf_counter())
    await client.stream("chat/completions", body, reply)  # SSE chunks -> reply (errors too)
    reply.metrics(time.perf_counter())                     # ClientMetrics: TTFT, E2E, tokens

A remote server exposes no engine telemetry (block map, step stats, queue times), so nothing here
pretends to: TTFT is send -> first content chunk as this client saw it, network included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 10.0
# Long enough for any honest request (vLLM's benchmark uses 6 hours too).
STREAM_TIMEOUT = httpx.Timeout(6 * 3600.0, connect=30.0, pool=None)


def api_url(base_url: str, path: str) -> str:
    """{base}/v1/{path}; accepts "http://host:port" and the OpenAI client's ".../v1"."""
    base = base_url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    async for line in resp.aiter_lines():
        data = line[5:].strip() if line.startswith("data:") else ""
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


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


@dataclass
class StreamReply:
    """What the chunks of one streamed reply said so far, and when (time.perf_counter seconds).
    Chat chunks carry `choices[0].delta.content`, completion chunks `choices[0].text`."""

    send_time: float
    content_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    request_id: str | None = None  # the server's id for the completion, once a chunk named it
    parts: list[str] = field(default_factory=list)  # the content of each content chunk
    finish_reason: str | None = None  # "abort" when this client closed the stream
    error: str | None = None
    usage: dict | None = None  # the server's usage report (stream_options.include_usage)
    # Chat logprobs' `content` entries, in order (asked with logprobs: true). A chunk may carry
    # them without content: a server holding text back (a possible stop string) still sends them.
    logprobs: list[dict] = field(default_factory=list)

    @property
    def first_content_time(self) -> float | None:
        return self.content_times[0] if self.content_times else None

    @property
    def text(self) -> str:
        return "".join(self.parts)

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
        chat_logprobs = choice.get("logprobs")
        if isinstance(chat_logprobs, dict) and isinstance(chat_logprobs.get("content"), list):
            self.logprobs += chat_logprobs["content"]
        content = choice.get("text") or (choice.get("delta") or {}).get("content")
        if not content:
            return False
        self.content_times.append(now)
        self.parts.append(content)
        return True

    def metrics(self, end_time: float) -> ClientMetrics:
        tokens = (self.usage or {}).get("completion_tokens")
        ttft = self.first_content_time
        return ClientMetrics(
            ttft_s=None if ttft is None else ttft - self.send_time,
            e2e_s=end_time - self.send_time,
            num_tokens=int(tokens) if tokens is not None else len(self.parts),
            tokens_from_usage=tokens is not None,
        )


class OpenAIClient:
    """Streaming POSTs to one server. An httpx.AsyncClient belongs to the event loop it was
    first used on, so one is made per loop; `async with` closes it (a one-reply client)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: httpx.Timeout = STREAM_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: httpx.MockTransport
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.transport = transport
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    def url(self, path: str) -> str:
        return api_url(self.base_url, path)

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = httpx.AsyncClient(
                headers=auth_headers(self.api_key),
                timeout=self.timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                transport=self.transport,
            )
            self._http_loop = loop
        return self._http

    async def stream(
        self,
        path: str,
        body: dict[str, Any],
        reply: StreamReply,
        on_content: Callable[[StreamReply], None] | None = None,
    ) -> None:
        """POST a streaming request and read its chunks into `reply`, calling on_content after
        each chunk with content. A refusal (HTTP status), an error chunk or a broken connection
        lands in reply.error; cancellation propagates (the connection is closed)."""
        try:
            async with self._client().stream("POST", self.url(path), json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    reply.error = f"HTTP {resp.status_code}: {error_message(text)}"
                    return
                async for chunk in sse_chunks(resp):
                    if reply.add(chunk, time.perf_counter()) and on_content is not None:
                        on_content(reply)
                    if reply.error:
                        return
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            reply.error = f"{type(e).__name__}: {e}"

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            with contextlib.suppress(RuntimeError):  # its event loop is gone: nothing to close
                await http.aclose()

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


# What each kind of server lets a client do about its prompt/prefix cache. Comparisons are honest
# only when every side's caching is known: a cached prompt skips its prefill, so TTFT drops.
CACHE_NOTES = {
    "llama.cpp": "llama.cpp prompt cache: off for load tests (cache_prompt: false per request)",
    "vllm": "vLLM prefix caching: a server flag (--enable-prefix-caching / "
    "--no-enable-prefix-caching), not controllable from the client",
    "sglang": "SGLang radix cache: a server flag (--disable-radix-cache), not controllable "
    "from the client",
    "ours": "our server: prefix caching off unless started with --enable-prefix-caching (a "
    "server flag, not controllable from the client)",
    "unknown": "server-side caching unknown: not controllable from the client",
}


def server_root(base_url: str) -> str:
    """The server's root URL (llama.cpp's /props is not under /v1)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def server_kind(card: dict, props: dict | None) -> str:
    """llama.cpp | vllm | sglang | ours | unknown, from what /v1/models and /props say."""
    if props is not None and "default_generation_settings" in props:
        return "llama.cpp"
    owner = str(card.get("owned_by", "")).lower()
    if owner == "inference-playground":
        return "ours"
    if owner in ("vllm", "sglang"):
        return owner
    if owner == "llamacpp" or isinstance(card.get("meta"), dict):
        return "llama.cpp"
    return "unknown"


def _positive_int(value: object) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return int(value) if ok else None  # type: ignore[arg-type]


def context_length(card: dict, props: dict | None) -> tuple[int | None, str]:
    """(tokens one request may span, where that number came from). vLLM, SGLang and ours put
    max_model_len in the model card; llama.cpp reports the per-slot context in /props (what a
    request can really use) and the model's training context in the card's meta."""
    if (n := _positive_int(card.get("max_model_len"))) is not None:
        return n, "max_model_len of /v1/models"
    settings = (props or {}).get("default_generation_settings") or {}
    if (n := _positive_int(settings.get("n_ctx"))) is not None:
        return n, "n_ctx per slot of /props"
    if (n := _positive_int((card.get("meta") or {}).get("n_ctx_train"))) is not None:
        return n, "meta.n_ctx_train of /v1/models"
    return None, "not reported"


def _get_json(url: str, headers: dict[str, str]) -> dict | None:
    """A JSON object from GET url, or None (no such route, or not JSON)."""
    try:
        resp = httpx.get(url, headers=headers, timeout=CONNECT_TIMEOUT_S)
        obj = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


@dataclass(frozen=True)
class RemoteServer:
    base_url: str  # as given, without a trailing slash
    model: str  # what requests send as "model"
    api_key: str | None = None
    max_model_len: int | None = None  # tokens one request may span, as the server reports it
    tokenizer_name: str | None = None  # builds load-test prompts (None: the model id)
    kind: str = "unknown"  # llama.cpp | vllm | sglang | ours | unknown (see server_kind)
    context_source: str = "not reported"  # which field max_model_len came from
    vocab_size: int | None = None  # llama.cpp's meta.n_vocab: bounds token-id prompts

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    @property
    def label(self) -> str:
        return f"{self.model} at {self.base_url}"

    @property
    def cache_note(self) -> str:
        return CACHE_NOTES[self.kind]

    def client(self, timeout: httpx.Timeout = STREAM_TIMEOUT) -> OpenAIClient:
        return OpenAIClient(self.base_url, self.api_key, timeout)

    @classmethod
    def connect(
        cls,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        tokenizer_name: str | None = None,
    ) -> RemoteServer:
        """Asks GET /v1/models which model is served (model=None: the first listed) and its
        context length (llama.cpp: GET /props too). ValueError says what went wrong, for the
        command line or the UI."""
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
        card = card or {}
        props = None
        if "max_model_len" not in card:  # llama.cpp (and unknown servers): ask /props
            props = _get_json(f"{server_root(base_url)}/props", server.headers)
        length, source = context_length(card, props)
        return replace(
            server,
            model=model or card["id"],
            max_model_len=length,
            kind=server_kind(card, props),
            context_source=source,
            vocab_size=_positive_int((card.get("meta") or {}).get("n_vocab")),
        )
