"""Where a load test sends its requests: the in-process engine or any OpenAI-compatible server.

Both targets time a request the same way: send -> first delta/chunk carrying output text or
tokens (TTFT) -> each further content delta (ITL) -> end of the stream (E2E), with
time.perf_counter() on the caller's event loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from playground.loadgen.metrics import RequestResult
from playground.loadgen.workload import GenRequest, Tokenizer, WorkloadSpec
from playground.remote.client import CACHE_NOTES, OpenAIClient, RemoteServer, StreamReply

if TYPE_CHECKING:
    from engine.request import RequestOutput
    from playground.engine_client import EngineClient
    from playground.remote.tokenizer import PromptTokenizer


class Target(Protocol):
    name: str
    notes: dict[str, str]  # what a reader of the results must know (caching, prompt tokens)

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def send(self, request: GenRequest, spec: WorkloadSpec) -> RequestResult: ...

    async def aclose(self) -> None: ...


class EngineTarget:
    """The in-process engine (an EngineService): what the UI's Load test tab drives."""

    def __init__(self, service: EngineClient) -> None:
        self.service = service
        self.name = f"engine:{service.model_name}"
        self.notes: dict[str, str] = {}

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
                n=spec.n,
            )
            stream = self.service.submit(request.prompt, params)
        except (ValueError, RuntimeError) as e:  # bad input, or the engine shutting down
            result.error = f"rejected: {e}"
            result.end_time = time.perf_counter()
            return result
        finals: dict[int, RequestOutput] = {}  # each sample's latest delta, by its index
        finished = False
        try:
            async for out in stream:
                now = time.perf_counter()
                # n > 1: the samples' deltas interleave; each one's tokens count (TTFT is
                # the first of any sample).
                if out.new_token_ids or out.new_text:
                    if result.first_token_time is None:
                        result.first_token_time = now
                    result.token_times.append(now)
                finals[out.index] = out
                finished = out.request_finished
        except Exception as e:  # the stream broke: a failure of this request, not of the test
            result.error = f"{type(e).__name__}: {e}"
        finally:
            result.end_time = time.perf_counter()
            if not finished:  # cancelled (the test was stopped) or failed: free its blocks
                self.service.abort(stream.request_id)
        if result.error is None:
            _take_outputs(result, [finals[i] for i in sorted(finals)])
        return result

    async def aclose(self) -> None:
        pass


def _take_outputs(result: RequestResult, outputs: list[RequestOutput]) -> None:
    """Fill `result` from each sample's last output (index order): every sample's tokens
    (ids concatenated in index order), the last sample's finish reason, the first error."""
    if not outputs:
        result.error = "stream ended without output"
        return
    first = outputs[0]
    result.prompt_tokens = len(first.prompt_token_ids)
    result.output_tokens = sum(len(o.token_ids) for o in outputs)
    result.output_token_ids = [t for o in outputs for t in o.token_ids]
    result.finish_reason = outputs[-1].finish_reason
    result.queue_s = first.metrics.queue_s if first.metrics is not None else None
    errors = [o.error for o in outputs if o.error]
    if errors:
        result.error = f"engine: {errors[0]}"
    elif any(o.finish_reason == "abort" for o in outputs):
        result.error = "aborted"


class OpenAITarget:
    """Any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp), via streaming
    /v1/completions through the playground's OpenAIClient. Token-id prompts are sent as lists
    of ids, which the OpenAI API accepts.

    The tokenizer builds random prompts; any whose ids the served model has gives exact lengths.
    Server-side caching: llama.cpp reuses a slot's cached prompt unless a request says
    `cache_prompt: false`, which this target sends (prompt_cache=False, the default) so a rerun,
    or Compare's second side on the same server, is not served from the first run's cache.
    Other servers' caches are server flags: `notes["caching"]` says so in the results.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        tokenizer: Tokenizer | None = None,
        client: OpenAIClient | None = None,  # default: one to base_url with api_key
        server_kind: str = "unknown",  # RemoteServer.kind: llama.cpp | vllm | sglang | ours
        prompt_cache: bool = False,  # llama.cpp only: keep its prompt cache on
        tokenizer_source: str | None = None,  # which tokenizer built the prompts, for notes
        salt_token_id: int | None = None,  # replaces each token-id prompt's first id (see below)
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.client = client or OpenAIClient(base_url, api_key)
        self.name = f"{base_url} ({model})"
        self.server_kind = server_kind
        self.prompt_cache = prompt_cache
        self.salt_token_id = salt_token_id
        self._tokenizer = tokenizer
        caching = CACHE_NOTES.get(server_kind, CACHE_NOTES["unknown"])
        if server_kind == "llama.cpp" and prompt_cache:
            caching = "llama.cpp prompt cache: on (its default; repeated prompts skip prefill)"
        self.notes = {"caching": caching}
        if tokenizer_source:
            self.notes["prompts"] = tokenizer_source
        if salt_token_id is not None:
            self.notes["salt"] = (
                f"each prompt's first token replaced by id {salt_token_id}: no prefix-cache "
                "hit on another run's prompts, lengths unchanged"
            )

    @classmethod
    def for_server(
        cls,
        server: RemoteServer,
        prompts: PromptTokenizer,
        prompt_cache: bool = False,
        salt_token_id: int | None = None,
    ) -> OpenAITarget:
        """The target for a connected server, prompts built by a resolved tokenizer chain."""
        return cls(
            server.base_url,
            server.model,
            server.api_key,
            tokenizer=prompts.tokenizer,
            server_kind=server.kind,
            prompt_cache=prompt_cache,
            tokenizer_source=prompts.source,
            salt_token_id=salt_token_id,
        )

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError(
                f"tokenizer: OpenAITarget({self.model!r}) needs the served model's tokenizer "
                "to build prompts; pass tokenizer=..."
            )
        return self._tokenizer

    def payload(self, request: GenRequest, spec: WorkloadSpec) -> dict[str, Any]:
        prompt = request.prompt
        if self.salt_token_id is not None and isinstance(prompt, list) and prompt:
            # Prefix caches match from the first token on (chained block hashes, llama.cpp's
            # common prefix), so one different first id makes every block a miss.
            prompt = [self.salt_token_id, *prompt[1:]]
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
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
        if spec.n > 1:  # sent only when used: n = 1 is every server's default
            body["n"] = spec.n
        if self.server_kind == "llama.cpp" and not self.prompt_cache:
            body["cache_prompt"] = False  # llama.cpp's own field; others may reject unknowns
        return body

    async def send(self, request: GenRequest, spec: WorkloadSpec) -> RequestResult:
        reply = StreamReply(send_time=time.perf_counter())
        await self.client.stream("completions", self.payload(request, spec), reply)
        end_time = time.perf_counter()
        metrics = reply.metrics(end_time)
        usage = reply.usage or {}
        return RequestResult(
            request.index,
            send_time=reply.send_time,
            first_token_time=reply.first_content_time,
            end_time=end_time,
            token_times=reply.content_times,
            prompt_tokens=int(usage.get("prompt_tokens") or request.prompt_len),
            # The server's usage report; without one (it ignored stream_options), one token
            # per content chunk.
            output_tokens=metrics.num_tokens,
            finish_reason=reply.finish_reason,
            error=reply.error,
        )

    async def aclose(self) -> None:
        await self.client.aclose()
