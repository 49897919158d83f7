"""Prometheus metrics of one engine, named like vLLM's (prefix `playground:` for `vllm:`).

Each EngineMetricsRegistry owns a CollectorRegistry, so several engines in one process (tests,
A/B comparisons) never clash in the global registry. The engine thread calls observe_*; the
HTTP server thread calls render(). prometheus_client metrics are thread-safe, so no extra lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.request import RequestMetrics
    from engine.telemetry.stats import StepStats

PREFIX = "playground:"
FINISH_REASONS = ("stop", "length", "abort")  # RequestStatus values of finished requests

# Buckets as in vLLM, plus finer low ends for GPU TPOTs.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EngineMetricsRegistry:
    """The engine's Prometheus series; every series carries the model_name label (as vLLM)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            metric = Counter(PREFIX + name, doc, list(labels), registry=self.registry)
            return metric.labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                PREFIX + name, doc, list(labels), registry=self.registry, buckets=buckets
            )
            return metric.labels(**labels)

        # --- per step (observe_step) ---
        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (fraction 0..1)."
        )
        self.num_preemptions = counter(
            "num_preemptions_total", "Cumulative number of preemptions from the engine."
        )
        self.engine_step_failures = counter(
            "engine_step_failures_total",
            "Engine steps whose forward pass raised; each failed the requests it held.",
        )

        # --- per finished request (observe_finished) ---
        self.prompt_tokens = counter("prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens_total", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            PREFIX + "request_success_total",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        for reason in FINISH_REASONS:  # show zeros before the first request, as vLLM does
            self._request_success.labels(model_name=model_name, finished_reason=reason)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        )  # fmt: skip
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (every gap between two tokens).",
            TPOT_BUCKETS_S,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of each request's mean time per output token after the first, seconds.",
            TPOT_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request, seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )

        # --- later features (observe_prefix_cache, observe_spec_decode) ---
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prefix-cache queries, in terms of number of tokens."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prefix-cache hits, in terms of number of cached tokens."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Number of draft tokens proposed."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total", "Number of draft tokens accepted."
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts_total", "Number of spec decoding drafts."
        )
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=self.registry,
        )

    def observe_step(self, step: StepStats) -> None:
        """Queue gauges, KV usage and preemptions after one engine step."""
        self.observe_queues(
            step.num_running, step.num_waiting, step.num_blocks_used, step.num_kv_blocks
        )
        if step.num_preemptions > 0:
            self.num_preemptions.inc(step.num_preemptions)

    def observe_step_failure(self) -> None:
        """One step whose forward pass raised (the engine failed its requests, recovered)."""
        self.engine_step_failures.inc()

    def observe_queues(
        self, num_running: int, num_waiting: int, num_blocks_used: int, num_kv_blocks: int
    ) -> None:
        """Queue gauges and KV usage now (after a step, or when requests end between steps)."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage_perc.set(num_blocks_used / num_kv_blocks if num_kv_blocks else 0.0)

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str) -> None:
        """Latency histograms and token counters of one finished request.

        Tokens are counted once per request at its end (prompt tokens once, however often a
        preemption made the engine recompute them), so the counters step at finish times.
        Latencies a request never reached (an abort before its first token) are skipped.
        """
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generation_tokens.inc(metrics.num_output_tokens)
        self._request_success.labels(
            model_name=self._model_name, finished_reason=finish_reason
        ).inc()
        for histogram, value in (
            (self.time_to_first_token, metrics.ttft_s),
            (self.request_time_per_output_token, metrics.tpot_s),
            (self.e2e_request_latency, metrics.e2e_s),
            (self.request_queue_time, metrics.queue_s),
        ):
            if value is not None:
                histogram.observe(value)
        for gap_s in metrics.itl_s:
            self.time_per_output_token.observe(gap_s)

    def observe_prefix_cache(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Prompt tokens looked up in the prefix cache and how many were found there."""
        self.prefix_cache_queries.inc(num_query_tokens)
        self.prefix_cache_hits.inc(num_hit_tokens)

    def observe_spec_decode(
        self, num_draft_tokens: int, num_accepted_tokens: int, num_drafts: int = 0,
        accepted_by_position: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """Draft tokens proposed by speculative decoding and how many the verifier accepted."""
        self.spec_decode_num_draft_tokens.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(num_accepted_tokens)
        if num_drafts:
            self.spec_decode_num_drafts.inc(num_drafts)
        for position, count in enumerate(accepted_by_position):
            labels = self._accepted_per_pos.labels(
                model_name=self._model_name, position=str(position)
            )
            labels.inc(count)

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's series (serve with content_type)."""
        return generate_latest(self.registry)
