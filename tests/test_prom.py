"""Prometheus registry: vLLM-style names, exposition parses, counters move, engines isolated."""

from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.request import RequestMetrics
from engine.telemetry.prom import EngineMetricsRegistry
from engine.telemetry.stats import StepStats


def samples(reg: EngineMetricsRegistry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from the rendered text."""
    out = {}
    for family in text_string_to_metric_families(reg.render().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def make_step(**overrides) -> StepStats:
    fields = dict(
        step_index=0,
        start_time=0.0,
        duration_s=0.01,
        kind="decode",
        num_prefill_tokens=0,
        num_decode_tokens=3,
        num_prefill_reqs=0,
        num_decode_reqs=3,
        batch_size=3,
        num_running=3,
        num_waiting=2,
        num_preemptions=1,
        num_blocks_used=25,
        num_blocks_free=75,
        num_kv_blocks=100,
        flops=1e9,
        bytes_moved=1e8,
    )
    return StepStats(**(fields | overrides))


def finished_metrics() -> RequestMetrics:
    m = RequestMetrics(arrival_time=10.0, num_prompt_tokens=7, num_output_tokens=3)
    m.first_scheduled_time = 10.5
    m.first_token_time = 11.0
    m.token_times = [11.0, 11.1, 11.3]
    m.finish_time = 11.3
    return m


def test_names_and_initial_values():
    reg = EngineMetricsRegistry(model_name="smollm2-135m")
    got = samples(reg)
    for name in (
        "playground:num_requests_running",
        "playground:num_requests_waiting",
        "playground:kv_cache_usage_perc",
        "playground:num_preemptions_total",
        "playground:prompt_tokens_total",
        "playground:generation_tokens_total",
        "playground:prefix_cache_queries_total",
        "playground:prefix_cache_hits_total",
        "playground:spec_decode_num_draft_tokens_total",
        "playground:spec_decode_num_accepted_tokens_total",
        "playground:time_to_first_token_seconds_count",
        "playground:time_per_output_token_seconds_count",
        "playground:e2e_request_latency_seconds_count",
        "playground:request_queue_time_seconds_count",
    ):
        assert got[(name, ())] == 0.0, name
    for reason in ("stop", "length", "abort"):
        assert got[("playground:request_success_total", (("finished_reason", reason),))] == 0
    assert "text/plain" in reg.content_type
    assert b'model_name="smollm2-135m"' in reg.render()


def test_observe_step_and_finished_move_series():
    reg = EngineMetricsRegistry()
    reg.observe_step(make_step())
    reg.observe_step(make_step(num_preemptions=2, num_running=1, num_waiting=0))
    reg.observe_finished(finished_metrics(), "stop")
    reg.observe_prefix_cache(num_query_tokens=32, num_hit_tokens=16)
    reg.observe_spec_decode(
        num_draft_tokens=8, num_accepted_tokens=5, num_drafts=2, accepted_by_position=[2, 2, 1]
    )
    got = samples(reg)
    assert got[("playground:num_requests_running", ())] == 1
    assert got[("playground:num_requests_waiting", ())] == 0
    assert got[("playground:kv_cache_usage_perc", ())] == 0.25
    assert got[("playground:num_preemptions_total", ())] == 3
    assert got[("playground:prompt_tokens_total", ())] == 7
    assert got[("playground:generation_tokens_total", ())] == 3
    assert got[("playground:request_success_total", (("finished_reason", "stop"),))] == 1
    assert got[("playground:time_to_first_token_seconds_sum", ())] == 1.0
    assert got[("playground:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.3)
    assert got[("playground:request_queue_time_seconds_sum", ())] == pytest.approx(0.5)
    # Two gaps (0.1 s and 0.2 s) go into the per-token histogram, one mean into the other.
    assert got[("playground:time_per_output_token_seconds_count", ())] == 2
    assert got[("playground:time_per_output_token_seconds_sum", ())] == pytest.approx(0.3)
    assert got[("playground:request_time_per_output_token_seconds_count", ())] == 1
    bucket = ("playground:time_per_output_token_seconds_bucket", (("le", "0.15"),))
    assert got[bucket] == 1  # the 0.1 s gap, not the 0.2 s one
    assert got[("playground:prefix_cache_hits_total", ())] == 16
    assert got[("playground:spec_decode_num_accepted_tokens_total", ())] == 5
    assert got[("playground:spec_decode_num_drafts_total", ())] == 2
    per_pos = "playground:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[(per_pos, (("position", str(i)),))] for i in range(3)] == [2, 2, 1]


def test_abort_before_first_token_skips_missing_latencies():
    reg = EngineMetricsRegistry()
    m = RequestMetrics(arrival_time=1.0, num_prompt_tokens=4)
    m.finish_time = 2.0
    reg.observe_finished(m, "abort")
    got = samples(reg)
    assert got[("playground:request_success_total", (("finished_reason", "abort"),))] == 1
    assert got[("playground:time_to_first_token_seconds_count", ())] == 0
    assert got[("playground:e2e_request_latency_seconds_count", ())] == 1


def test_two_engines_do_not_clash():
    a, b = EngineMetricsRegistry("a"), EngineMetricsRegistry("b")
    a.observe_step(make_step(num_preemptions=4))
    assert samples(a)[("playground:num_preemptions_total", ())] == 4
    assert samples(b)[("playground:num_preemptions_total", ())] == 0


def test_render_while_engine_thread_observes():
    reg = EngineMetricsRegistry()
    num_steps = 2000
    errors = []

    def engine_loop() -> None:
        for _ in range(num_steps):
            reg.observe_step(make_step(num_preemptions=1))
            reg.observe_finished(finished_metrics(), "length")

    def scraper() -> None:
        try:
            for _ in range(50):
                samples(reg)
        except Exception as e:  # pragma: no cover - the failure is the assertion below
            errors.append(e)

    threads = [threading.Thread(target=engine_loop), threading.Thread(target=scraper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = samples(reg)
    assert got[("playground:num_preemptions_total", ())] == num_steps
    assert got[("playground:request_success_total", (("finished_reason", "length"),))] == num_steps
    assert got[("playground:generation_tokens_total", ())] == 3 * num_steps
