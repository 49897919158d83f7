"""LLMEngine: add_request / abort / step over the scheduler, the model runner and telemetry.

Single-threaded by design: EngineService (engine/serving/service.py) drives it from one thread, and
LLM (engine/llm.py) drives it in the caller's thread for offline batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, BlockSnapshot
from engine.core.detokenizer import detokenize_new, find_stop, init_offsets, stop_holdback
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.spec_decode import propose_ngram
from engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    new_request_id,
)
from engine.runner.model_loader import load_tokenizer, resolve_model
from engine.runner.model_runner import ModelRunner
from engine.telemetry.cost import ModelShape, StepCost, step_cost
from engine.telemetry.stats import (
    EngineStats,
    FinishedRequest,
    RequestProgress,
    RingBuffer,
    StepStats,
    step_kind,
)

try:
    from engine.telemetry.prom import EngineMetricsRegistry
except ImportError:  # no prometheus_client (GPU check machines have torch + triton only)
    from engine.telemetry.prom_null import NullMetricsRegistry as EngineMetricsRegistry

logger = logging.getLogger(__name__)

# Longest context the engine allocates RoPE tables for when the model allows more.
_DEFAULT_MAX_MODEL_LEN = 8192

Prompt = str | Sequence[int]
_CHAT_ROLES = ("system", "user", "assistant")  # the server maps "developer" to system


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model)
        self.model_name = self.source.name
        self.tokenizer = load_tokenizer(self.source)
        arch = self.source.arch
        self.max_model_len = config.max_model_len or min(
            arch.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN
        )
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}"
            )
        self.runner = ModelRunner(config, self.source, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.kv_spec.num_blocks,
            config.block_size,
            config.kv_layout,
            self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            batching=config.batching,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.eos_token_ids = self._eos_token_ids()
        self.shape = ModelShape(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            tie_word_embeddings=arch.tie_word_embeddings,
            weight_bytes_per_param=self.runner.dtype.itemsize,
            kv_bytes_per_element=self.runner.dtype.itemsize,
        )
        self.step_history: RingBuffer[StepStats] = RingBuffer(config.step_history_len)
        self.finished_history: RingBuffer[FinishedRequest] = RingBuffer(config.request_history_len)
        self.metrics_registry = EngineMetricsRegistry(model_name=self.model_name)
        self._requests: dict[str, Request] = {}
        self._num_steps = 0
        self.num_draft_tokens_total = 0  # speculative tokens proposed and verified
        self.num_accepted_tokens_total = 0  # of those, accepted

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.source.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # --- requests in ---
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"prompt: model {self.model_name!r} has no tokenizer; pass ids")
            return list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, list | tuple):
            raise ValueError(f"prompt: must be a string or a list of token ids, got {prompt!r}")
        ids = list(prompt)
        vocab = self.source.arch.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        return ids

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: model {self.model_name!r} has no chat template")
        if not messages:
            raise ValueError("messages: must not be empty")
        for message in messages:  # caught here, not as a jinja error inside the template
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise ValueError(f"messages: each needs a string 'content', got {message!r}")
            if message.get("role") not in _CHAT_ROLES:
                raise ValueError(
                    f"messages: role must be one of {', '.join(_CHAT_ROLES)}, "
                    f"got {message.get('role')!r}"
                )
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and tokenize; safe to call from any thread (touches no engine state)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(prompt_ids) > budget:
            # Unchunked, it could never be scheduled (and would block the queue behind it).
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens exceed max_num_batched_tokens={budget}, "
                "the most one step computes without chunked prefill; shorten it, raise "
                "max_num_batched_tokens or enable chunked prefill"
            )
        max_total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        blocks = self.block_manager.max_blocks_for(max_total)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt: this request needs up to {blocks} KV blocks "
                f"({max_total} tokens, {self.config.kv_layout} layout) but the cache has only "
                f"{self.block_manager.num_blocks}; shorten it, lower max_tokens or grow the cache"
            )
        request = Request(
            request_id=request_id or new_request_id(),
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) else None,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=max_total,
        )
        init_offsets(request)
        return request

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The default max_tokens for a prompt (as vLLM): the rest of max_model_len, capped by
        what the KV pool can hold for one request."""
        bm = self.block_manager
        room = min(self.max_model_len, bm.num_blocks * bm.block_size) - num_prompt_tokens
        return max(1, room)

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self._requests[request.request_id] = request
        self.scheduler.add_request(request)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:  # fmt: skip
        request = self.make_request(prompt, params, request_id)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._finalize(request, new_token_ids=[])

    def abort_all(self, error: str | None = None) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self._requests):
            out = self.abort(request_id)
            if out is not None:
                out.error = error
                outputs.append(out)
        return outputs

    @property
    def num_steps(self) -> int:
        """Steps run since start-up."""
        return self._num_steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ---
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.config.speculative_method == "ngram":
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        # The step's shape, taken before update() advances num_computed_tokens.
        num_new = [s.num_new_tokens for s in sched.scheduled]
        context = [s.request.num_computed_tokens + s.num_new_tokens for s in sched.scheduled]
        num_logits = sum(s.samples + s.num_draft_tokens for s in sched.scheduled)
        cost = step_cost(self.shape, num_new, context, num_logits)
        drafts = {s.request.request_id: s.num_draft_tokens for s in sched.scheduled}
        num_decode_reqs = sum(s.is_decode for s in sched.scheduled)
        sampled = self.runner.execute(sched)
        self.runner.synchronize()
        now = time.perf_counter()
        touched = self.scheduler.update(sched, sampled, now)
        outputs = [self._output_for(request) for request in touched]
        # Drafts verified this step, and how many were accepted (tokens appended minus one).
        num_drafts = sum(drafts.values())
        num_accepted = sum(
            max(0, len(tokens) - 1) for rid, tokens in sampled.items() if drafts.get(rid)
        )
        self._record_step(
            sched, cost, start, time.perf_counter(), num_decode_reqs, num_drafts, num_accepted
        )
        return outputs

    def _propose_drafts(self) -> None:
        """N-gram drafts for every running request that is decoding (spec_decode.py), capped
        so that even if all are accepted the request stays within max_tokens and
        max_model_len."""
        config = self.config
        for request in self.scheduler.running:
            if request.num_computed_tokens + 1 != request.num_tokens:
                continue  # still prefilling
            room = min(
                config.num_speculative_tokens,
                request.params.max_tokens - request.num_output_tokens - 1,
                request.max_total_tokens - request.num_tokens - 1,
            )
            request.draft_token_ids = propose_ngram(
                request.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max
            )

    def _output_for(self, request: Request) -> RequestOutput:
        if self.tokenizer is not None:
            self._detokenize(request)
        num_new = request.num_new_output_tokens  # 1, or more after verified drafts
        new_token_ids = request.output_token_ids[len(request.output_token_ids) - num_new :]
        if request.finished:
            return self._finalize(request, new_token_ids)
        return self._delta(request, new_token_ids)

    def _detokenize(self, request: Request) -> None:
        """Extend the request's text with this step's tokens; end it at a stop string.

        Several tokens (verified drafts) are taken one at a time when stop strings are set,
        so that the request ends at the token that completed the stop string and the tokens
        after it are dropped, exactly as one-token decoding would have ended it."""
        num_new = request.num_new_output_tokens
        if num_new <= 1 or not request.params.stop:
            self._extend_text(request, final=request.finished)
            return
        tokens = request.output_token_ids[-num_new:]
        del request.output_token_ids[-num_new:]
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            if self._extend_text(request, final=request.finished and i == num_new - 1):
                dropped = num_new - 1 - i
                if dropped:
                    del request.metrics.token_times[-dropped:]
                    request.num_new_output_tokens -= dropped
                    request.metrics.num_output_tokens -= dropped
                return

    def _extend_text(self, request: Request, final: bool) -> bool:
        """Detokenize up to the last output token; True when a stop string ended the request."""
        new_text = detokenize_new(self.tokenizer, request, final=final)
        params = request.params
        cut = find_stop(request.output_text, params.stop, len(new_text)) if new_text else None
        if cut is None:
            return False
        request.output_text = request.output_text[:cut]
        if request.finished:  # the same token also hit a length limit: stop wins
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return True

    def _delta(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        # While streaming, hold back text that could be the start of a stop string.
        sendable = len(request.output_text)
        if request.params.stop and not request.finished:
            sendable -= stop_holdback(request.params.stop)
        sent = request.num_text_chars_sent
        new_text = request.output_text[sent:sendable] if sendable > sent else ""
        request.num_text_chars_sent = max(sent, sendable)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=request.output_text[: request.num_text_chars_sent],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            metrics=request.metrics,
        )

    def _finalize(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        self._requests.pop(request.request_id, None)
        self.runner.release(request.request_id)
        reason = request.finish_reason or "abort"
        self.finished_history.append(FinishedRequest(request.request_id, reason, request.metrics))
        self.metrics_registry.observe_finished(request.metrics, reason)
        return self._delta(request, new_token_ids)

    def _record_step(
        self, sched: SchedulerOutput, cost: StepCost, start: float, end: float,
        num_decode_reqs: int, num_drafts: int, num_accepted: int,
    ) -> None:  # fmt: skip
        bm = self.block_manager
        stats = StepStats(
            step_index=self._num_steps,
            start_time=start,
            duration_s=end - start,
            kind=step_kind(sched.num_prefill_tokens, sched.num_decode_tokens),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_prefill_reqs=len(sched.scheduled) - num_decode_reqs,
            num_decode_reqs=num_decode_reqs,
            batch_size=len(sched.scheduled),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=len(sched.preempted_ids),
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_kv_blocks=bm.num_blocks,
            flops=cost.flops,
            bytes_moved=cost.bytes_moved,
            num_blocks_cached=bm.num_cached_blocks if bm.enable_prefix_caching else 0,
            num_prefix_query_tokens=sched.num_prefix_query_tokens,
            num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
        )
        if num_drafts:
            self.num_draft_tokens_total += num_drafts
            self.num_accepted_tokens_total += num_accepted
            self.metrics_registry.observe_spec_decode(num_drafts, num_accepted)
        if sched.num_prefix_query_tokens:
            self.scheduler.num_prefix_query_tokens_total += sched.num_prefix_query_tokens
            self.scheduler.num_prefix_hit_tokens_total += sched.num_prefix_hit_tokens
            self.metrics_registry.observe_prefix_cache(
                sched.num_prefix_query_tokens, sched.num_prefix_hit_tokens
            )
        self._num_steps += 1
        self.step_history.append(stats)
        self.metrics_registry.observe_step(stats)

    # --- snapshots ---
    def stats(self) -> EngineStats:
        """Cheap and lock-free: counters plus copies of the ring buffers."""
        return EngineStats(
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            block_size=self.config.block_size,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_prefix_query_tokens_total=self.scheduler.num_prefix_query_tokens_total,
            num_prefix_hit_tokens_total=self.scheduler.num_prefix_hit_tokens_total,
            num_cached_kv_blocks=self.block_manager.num_cached_blocks,
            num_prefix_evictions_total=self.block_manager.num_evictions_total,
            num_draft_tokens_total=self.num_draft_tokens_total,
            num_accepted_tokens_total=self.num_accepted_tokens_total,
            num_steps_total=self._num_steps,
            steps=self.step_history.snapshot(),
            finished=self.finished_history.snapshot(),
        )

    def block_snapshot(self) -> BlockSnapshot:
        return self.block_manager.snapshot()

    def queue_snapshot(self) -> list[RequestProgress]:
        rows = []
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            rows.append(
                RequestProgress(
                    request_id=request.request_id,
                    status=request.status.value,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_computed_tokens=request.num_computed_tokens,
                    num_output_tokens=request.num_output_tokens,
                    max_tokens=request.params.max_tokens,
                    num_blocks=len(self.block_manager.block_table(request.request_id)),
                )
            )
        return rows
