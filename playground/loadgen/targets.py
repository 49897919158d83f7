"""Where a load test sends its requests: the in-process engine or any OpenAI-compatible server.

Both targets time a request the same way: send -> first delta/chunk carrying output text or
tokens (TTFT) -> each further content delta (ITL) -> end of the stream (E2E), with
time.perf_counter() on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Protocol

import httpx

from playground.loadgen.metrics import RequestResult
from playground.loadgen.workload import GenRequest, Tokenizer, WorkloadSpec

# Long enough for any honest request (vLLM's benchmark uses 6 hours too).
HTTP_TIMEOUT_S = 6 * 3600.0


class Target(Protocol):
    name: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def send(self, request: GenRequest, spec: WorkloadSpec) -> RequestResult: ...

    async def aclose(self) -> None: ...


class EngineTarget:
    """The in-process engine (an EngineService): what the UI's Load test tab drives."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.name = f"engine:{getattr(service, 'model_name', 'engine')}"

    @property
    def tokenizer(self) -> Tokenizer:
        return self.service.tokenizer

    async def send(self, request: GenRequest, spec: WorkloadSpec) -> RequestResult:
        from engine import SamplingParams  # playground reaches the engine only via its API

        result = RequestResult(request.index, send_time=time.perf_counter())
        try:
            params = SamplingParams(
                max_tokens=request.output_len,
                temperature=spec.temperature,
                top_p=spec.top_p,
                top_k=spec.top_k,
                min_p=spec.min_p,
                ignore_eos=spec.ignore_eos,
            )
            stream = self.service.submit(request.prompt, params)
        except (ValueError, RuntimeError) as e:  # bad input, or the engine shutting down
            result.error = f"rejected: {e}"
            result.end_time = time.perf_counter()
            return result
        last = None
        finished = False
        try:
            async for out in stream:
                now = time.perf_counter()
                if out.new_token_ids or out.new_text:
                    if result.first_token_time is None:
                        result.first_token_time = now
                    result.token_times.append(now)
                last = out
                finished = out.finished
        except Exception as e:  # the stream broke: a failure of this request, not of the test
            result.error = f"{type(e).__name__}: {e}"
        finally:
            result.end_time = time.perf_counter()
            if not finished:  # cancelled (the test was stopped) or failed: free its blocks
                self.service.abort(stream.request_id)
        if result.error is not None:
            return result
        if last is not None:
            result.prompt_tokens = len(last.prompt_token_ids)
            result.output_tokens = len(last.token_ids)
            result.finish_reason = last.finish_reason
            result.queue_s = last.metrics.queue_s if last.metrics is not None else None
            if last.error:
                result.error = f"engine: {last.error}"
            elif last.finish_reason == "abort":
                result.error = "aborted"
        else:
            result.error = "stream ended without output"
        return result

    async def aclose(self) -> None:
        pass


def _completions_url(base_url: str) -> str:
    """Accepts both "http://host:port" and the OpenAI client's "http://host:port/v1"."""
    base = base_url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


class OpenAITarget:
    """Any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp), via streaming
    /v1/completions. Token-id prompts are sent as lists of ids, which the OpenAI API accepts.

    The tokenizer builds random prompts; it must be the served model's for exact lengths.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.url = _completions_url(base_url)
        self.name = f"{base_url} ({model})"
        self._tokenizer = tokenizer
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError(
                f"tokenizer: OpenAITarget({self.model!r}) needs the served model's tokenizer "
                "to build prompts; pass tokenizer=..."
            )
        return self._tokenizer

    def _http(self) -> httpx.AsyncClient:
        # An AsyncClient belongs to the event loop it was first used on.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            )
            self._client_loop = loop
        return self._client

    def payload(self, request: GenRequest, spec: WorkloadSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "temperature": spec.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.top_p < 1:
            body["top_p"] = spec.top_p
        # Extensions (vLLM, SGLang, llama.cpp and ours have them): sent only when used.
        if spec.top_k > 0:
            body["top_k"] = spec.top_k
        if spec.min_p > 0:
            body["min_p"] = spec.min_p
        if spec.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, request: GenRequest, spec: WorkloadSpec) -> RequestResult:
        result = RequestResult(request.index, send_time=time.perf_counter())
        result.prompt_tokens = request.prompt_len
        usage = None
        num_chunks = 0
        try:
            async with self._http().stream(
                "POST", self.url, json=self.payload(request, spec)
            ) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                    result.end_time = time.perf_counter()
                    return result
                async for line in resp.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if not data:
                        continue
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        result.error = f"stream error: {_error_message(data)}"
                        break
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        if result.first_token_time is None:
                            result.first_token_time = now
                        result.token_times.append(now)
                        num_chunks += 1
                    if choices and choices[0].get("finish_reason"):
                        result.finish_reason = choices[0]["finish_reason"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            result.end_time = time.perf_counter()
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}"
            result.end_time = time.perf_counter()
            return result
        if usage is not None:
            result.prompt_tokens = int(usage.get("prompt_tokens") or request.prompt_len)
            result.output_tokens = int(usage.get("completion_tokens") or 0)
        else:  # the server ignored stream_options.include_usage: one token per chunk
            result.output_tokens = num_chunks
        return result

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(RuntimeError):  # its event loop is gone: nothing to close
                await client.aclose()


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err)[:300]
