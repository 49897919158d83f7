"""LLMEngine: add_request / abort / step over the scheduler, the model runner and telemetry.

The engine validates and tokenizes requests, then wires the parts of a step together and owns
none of their work: the proposer drafts (spec_decode.py), the scheduler picks the work and
carries the drafts in SchedulerOutput (scheduler.py), the model runner computes it
(engine/runner), the scheduler appends the tokens, the OutputProcessor turns them into deltas
(output.py) and the StepRecorder records the step (engine/telemetry/recorder.py).

Single-threaded by design: EngineService (engine/serving/service.py) drives it from one thread, and
LLM (engine/llm.py) drives it in the caller's thread for offline batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from engine.core.block_manager import BlockManager, BlockSnapshot
from engine.core.chat_template import tokenize_chat
from engine.core.output import OutputProcessor
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.spec_decode import DraftSlotProposer, NgramProposer
from engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    new_request_id,
)
from engine.runner.model_loader import load_tokenizer, resolve_model
from engine.runner.model_runner import ModelRunner
from engine.telemetry.cost import ModelShape, kv_bytes_per_element
from engine.telemetry.prom_null import NullMetricsRegistry
from engine.telemetry.recorder import MetricsSink, StepRecorder
from engine.telemetry.stats import EngineStats, RequestProgress

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
_CHAT_ROLES = ("system", "user", "assistant")  # the server maps "developer" to system


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        make_metrics: Callable[[str], MetricsSink] = NullMetricsRegistry,
    ) -> None:
        """`make_metrics(model_name)` builds the metrics sink (the null one by default; LLM and
        EngineService pass a Prometheus registry's factory: engine/telemetry/prom_null.py)."""
        self.config = config
        self.source = resolve_model(
            config.model, config.quantization, config.quantization_group_size
        )
        self.model_name = self.source.name
        self.tokenizer = load_tokenizer(self.source)
        arch = self.source.arch
        self.max_model_len = config.max_model_len or min(
            arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
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
            enable_prompt_sharing=config.enable_prompt_sharing,
        )
        self.eos_token_ids = self._eos_token_ids()
        itemsize = self.runner.dtype.itemsize
        self.shape = ModelShape.from_arch(
            arch,
            itemsize,
            kv_bytes_per_element=kv_bytes_per_element(
                config.kv_cache_dtype, itemsize, arch.head_dim
            ),
            linear_bytes_per_param=self.runner.linear_bytes_per_param,
        )
        self.metrics_registry = make_metrics(self.model_name)  # /metrics renders it
        self.recorder = StepRecorder(
            self.shape,
            self.scheduler,
            self.block_manager,
            self.metrics_registry,
            step_history_len=config.step_history_len,
            request_history_len=config.request_history_len,
            draft_shape=self._draft_shape(),
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.proposer = _make_proposer(config)
        self._requests: dict[str, Request] = {}  # every sequence, by its own id
        # The caller's request id -> its sequences (one, or n with parallel sampling).
        self._groups: dict[str, list[Request]] = {}

    def _draft_shape(self) -> ModelShape | None:
        """The draft model's shape for the cost model (None without one)."""
        drafter = self.runner.drafter
        if drafter is None:
            return None
        itemsize = self.runner.dtype.itemsize
        summary = drafter.quant_summary
        return ModelShape.from_arch(
            drafter.arch,
            itemsize,
            kv_bytes_per_element=kv_bytes_per_element(
                self.config.kv_cache_dtype, itemsize, drafter.arch.head_dim
            ),
            linear_bytes_per_param=summary.linear_bytes_per_param if summary else None,
        )

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
        # Content is tokenized apart from the template's markers, so "<|im_end|>" typed by a
        # user stays text and cannot open a turn of another role (chat_template.py says how).
        return tokenize_chat(self.tokenizer, list(messages))

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
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n: {params.n} sequences exceed max_num_seqs={self.config.max_num_seqs}, the "
                "most that run at once (all n of a request run together)"
            )
        vocab = self.source.arch.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted: the largest id
            raise ValueError(
                f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary "
                f"[0, {vocab})"
            )
        max_total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        blocks = self.block_manager.max_blocks_for(max_total)
        if params.n > 1 and blocks * params.n > self.block_manager.num_blocks:
            # Shared prompt blocks aside, n full-length sequences must fit at once, or the
            # group (preempted as a unit) could never finish.
            raise ValueError(
                f"n: {params.n} sequences need up to {blocks * params.n} KV blocks "
                f"({max_total} tokens each) but the cache has only "
                f"{self.block_manager.num_blocks}; lower n or max_tokens, or grow the cache"
            )
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt: this request needs up to {blocks} KV blocks "
                f"({max_total} tokens, {self.config.kv_layout} layout) but the cache has only "
                f"{self.block_manager.num_blocks}; shorten it, lower max_tokens or grow the cache"
            )
        group_id = request_id or new_request_id()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        # n = 1: one sequence under the caller's id. n > 1: "<id>#<i>" each; sequence 0 comes
        # back, carrying the others until they fork off it (scheduler._fork_if_ready).
        sequences = [
            Request(
                request_id=group_id if params.n == 1 else f"{group_id}#{i}",
                prompt_token_ids=prompt_ids if i == 0 else list(prompt_ids),
                params=params,
                arrival_time=arrival,
                prompt=prompt if isinstance(prompt, str) else None,
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=max_total,
                group_id=group_id,
                sample_index=i,
            )
            for i in range(params.n)
        ]
        for sequence in sequences:
            self.outputs.start(sequence)
        sequences[0].pending_samples = sequences[1:]
        return sequences[0]

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The default max_tokens for a prompt (as vLLM): the rest of max_model_len, capped by
        what the KV pool can hold for one request."""
        bm = self.block_manager
        room = min(self.max_model_len, bm.num_blocks * bm.block_size) - num_prompt_tokens
        return max(1, room)

    def add(self, request: Request) -> None:
        if request.group_id in self._groups:
            raise ValueError(f"request_id: {request.group_id!r} is already in the engine")
        sequences = [request, *request.pending_samples]
        self._groups[request.group_id] = sequences
        for sequence in sequences:
            self._requests[sequence.request_id] = sequence
        self.scheduler.add_request(request)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:  # fmt: skip
        request = self.make_request(prompt, params, request_id)
        self.add(request)
        return request.group_id  # the caller's id (sequence i of n > 1 is "<id>#<i>")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its n sequences); returns its last output, or None if it
        is not in the engine."""
        outputs = self._abort(request_id)
        return outputs[-1] if outputs else None

    def _abort(self, request_id: str) -> list[RequestOutput]:
        """Abort a caller's request (every sequence of it) or one sequence by its own id;
        returns the final outputs of the sequences that were still running."""
        sequences = self._groups.get(request_id)
        if sequences is None:
            one = self._requests.get(request_id)
            sequences = [one] if one is not None else []
        outputs: list[RequestOutput] = []
        for sequence in sequences:
            outputs += self._abort_sequence(sequence)
        return self._mark_request_finished(outputs)

    def _abort_sequence(self, request: Request) -> list[RequestOutput]:
        if request.finished:
            return []
        if self.scheduler.abort(request.request_id) is None:  # a sample not forked yet
            request.status = RequestStatus.FINISHED_ABORTED
            request.metrics.finish_time = time.perf_counter()
        self._release([request])
        outputs = [self.outputs.final_output(request)]
        samples, request.pending_samples = request.pending_samples, []
        for sample in samples:  # nothing left to fork them off
            outputs += self._abort_sequence(sample)
        return outputs

    def abort_all(self, error: str | None = None) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self._groups):
            for out in self._abort(request_id):
                out.error = error
                outputs.append(out)
        return outputs

    def _mark_request_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Set request_finished on the last output of each request with no running sequence
        left (only the last: a stream ends on it, so the n sequences' final deltas of one
        step must all come before it), and forget those requests."""
        seen = set()
        for out in reversed(outputs):
            if out.request_id in seen:
                out.request_finished = False
                continue
            seen.add(out.request_id)
            sequences = self._groups.get(out.request_id, ())
            out.request_finished = all(s.finished for s in sequences)
            if out.request_finished:
                self._groups.pop(out.request_id, None)
        return outputs

    @property
    def num_steps(self) -> int:
        """Steps run since start-up."""
        return self.recorder.num_steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ---
    def step(self) -> list[RequestOutput]:
        start_time = time.perf_counter()
        drafts = self.proposer.propose(self.scheduler.running) if self.proposer else {}
        sched = self.scheduler.schedule(drafts)
        if sched.is_empty:
            return []
        start = self.recorder.start_step(sched, start_time)  # before update() advances requests
        try:
            execute_start = time.perf_counter()
            result = self.runner.execute(sched)
            self.runner.synchronize()
            execute_time_s = time.perf_counter() - execute_start
        except Exception as exc:
            return self._fail_step(sched, exc)
        # Requests whose sampling raised fail alone, before update(), which then skips them
        # (no longer running) and advances the rest exactly as if they had run without them.
        outputs = [
            out
            for rid, why in result.failed.items()
            for out in self._fail(rid, f"engine error: {why}")
        ]
        touched = self.scheduler.update(
            sched, result.sampled, time.perf_counter(), result.logprobs, result.prompt_logprobs
        )
        outputs += self.outputs.process(touched)  # may finish requests (stop strings, errors)
        self._release([request for request in touched if request.finished])
        self.recorder.record_step(start, sched, result.sampled, time.perf_counter(),
                                  result.draft_time_s, execute_time_s,
                                  result.draft_passes)  # fmt: skip
        return self._mark_request_finished(outputs)

    def step_or_raise(self) -> list[RequestOutput]:
        """step() for callers that run requests to the end in their own thread (LLM.generate,
        benchmarks): raises RuntimeError when requests are left but the step scheduled none, as
        stepping again would change nothing. (The server's loop waits for a submit instead.)"""
        num_steps = self.num_steps
        outputs = self.step()
        if not outputs and self.num_steps == num_steps and self.has_unfinished():
            raise RuntimeError("engine: requests are left but none can be scheduled")
        return outputs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass raised: fail every request of the step with the error and carry on.

        Failed, not retried: a fault that a step's inputs trigger would fail again on every
        retry, and a retry loop would hold the blocks and the queue behind it. Aborting frees
        each one's blocks (those the step had just allocated included) and drops it from the
        running queue; requests not in the step (waiting, or preempted by this schedule())
        are untouched and run in later steps. Nothing was cached for prefix reuse, as that
        happens in update(), which this step never reaches."""
        logger.exception("engine step %d failed; failing its %d requests",
                         self.num_steps, len(sched.scheduled))  # fmt: skip
        self.recorder.record_step_failure()
        error = f"engine error: forward pass failed: {type(exc).__name__}: {exc}"
        return [out for s in sched.scheduled for out in self._fail(s.request.request_id, error)]

    def _fail(self, request_id: str, error: str) -> list[RequestOutput]:
        """Abort one sequence because the engine failed it; its final output carries `error`
        (the other sequences of its request, if any, go on)."""
        outputs = self._abort(request_id)
        for out in outputs:
            out.error = error
        return outputs

    def _release(self, finished: Iterable[Request]) -> None:
        """Forget finished requests: drop the runner's per-request state, record them."""
        for request in finished:
            self._requests.pop(request.request_id, None)
            self.runner.release(request.request_id)
            reason = request.finish_reason or "abort"
            self.recorder.record_finished(request.request_id, reason, request.metrics)

    # --- snapshots ---
    def stats(self) -> EngineStats:
        """Cheap and lock-free: counters plus copies of the ring buffers."""
        recorder = self.recorder
        return EngineStats(
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            block_size=self.config.block_size,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_prefix_query_tokens_total=recorder.num_prefix_query_tokens_total,
            num_prefix_hit_tokens_total=recorder.num_prefix_hit_tokens_total,
            num_cached_kv_blocks=self.block_manager.num_cached_blocks,
            num_prefix_evictions_total=self.block_manager.num_evictions_total,
            num_draft_tokens_total=recorder.num_draft_tokens_total,
            num_accepted_tokens_total=recorder.num_accepted_tokens_total,
            num_spec_proposals_total=recorder.num_spec_proposals_total,
            num_draft_tokens_by_position=tuple(recorder.num_draft_tokens_by_position),
            num_accepted_tokens_by_position=tuple(recorder.num_accepted_tokens_by_position),
            draft_kv_cache_bytes=self.runner.draft_kv_cache_bytes,
            num_block_copies_total=self.block_manager.num_block_copies_total,
            kv_cache_dtype=self.runner.kv_cache_dtype_name,
            attention_backend=self.runner.attn_backend.description,
            layer_ops=self.runner.layer_ops_description,
            matmul_dtype=self.runner.matmul_dtype,
            num_steps_total=recorder.num_steps,
            num_step_failures_total=recorder.num_step_failures_total,
            steps=recorder.step_history.snapshot(),
            finished=recorder.finished_history.snapshot(),
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


def _make_proposer(config: EngineConfig) -> NgramProposer | DraftSlotProposer | None:
    """N-gram drafts come as tokens; the draft model's as slots the runner fills."""
    if config.speculative_method == "ngram":
        return NgramProposer(config)
    if config.speculative_method == "draft":
        return DraftSlotProposer(config)
    return None
