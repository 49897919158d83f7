"""The engine's own accounting: KV bytes match the formula, step intensities land where the
roofline says they should, and the Prometheus series move as requests run."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, EngineConfig, SamplingParams
from engine.telemetry.cost import kv_cache_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_tensor_bytes_equal_the_formula(dtype):
    llm = LLM(model="random:tiny", dtype=dtype, num_kv_blocks=40, block_size=16)
    arch = llm.engine.source.arch
    itemsize = 4 if dtype == "float32" else 2
    expected = kv_cache_bytes(arch.num_layers, arch.num_kv_heads, arch.head_dim,
                              num_tokens=40 * 16, batch_size=1, bytes_per_element=itemsize)  # fmt: skip
    assert llm.stats().kv_cache_bytes == expected


def test_kv_budget_sizes_the_cache():
    budget = 10 * 2**20
    llm = LLM(model="random:tiny", dtype="float32", kv_cache_memory_bytes=budget)
    stats = llm.stats()
    bytes_per_block = stats.kv_cache_bytes // stats.num_kv_blocks
    assert stats.kv_cache_bytes <= budget < stats.kv_cache_bytes + bytes_per_block


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(dtype="bfloat16", max_model_len=1024, num_kv_blocks=128)


def test_prefill_steps_are_far_more_intense_than_decode_steps(llm_bf16):
    llm = llm_bf16
    long_prompt = [(i * 37) % 40000 + 100 for i in range(400)]
    llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    prefill = [s for s in llm.stats().steps if s.kind == "prefill"]
    assert prefill and min(s.arithmetic_intensity for s in prefill) >= 100

    intensity_by_batch = {}
    for batch in (1, 8):
        prompts = [[(i * 13 + j) % 40000 + 100 for j in range(8)] for i in range(batch)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)
        decodes = [s for s in llm.stats().steps[-5:] if s.kind == "decode"]
        assert decodes and all(s.batch_size == batch for s in decodes)
        intensity_by_batch[batch] = decodes[-1].arithmetic_intensity
    assert intensity_by_batch[1] < 2  # ~1 FLOP/byte: every weight read for one token
    assert intensity_by_batch[8] > 4 * intensity_by_batch[1]  # batching amortizes weights
    assert intensity_by_batch[8] < min(s.arithmetic_intensity for s in prefill) / 10
    for step in llm.stats().steps:
        assert step.flops > 0 and step.bytes_moved > 0 and step.duration_s > 0


def _samples(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason", "")
            key = f"{sample.name}{{{reason}}}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


def test_prometheus_series_move(llm_bf16):
    registry = llm_bf16.engine.metrics_registry
    before = _samples(registry.render().decode())
    llm_bf16.generate([[100, 200, 300]], SamplingParams(max_tokens=5, ignore_eos=True))
    after = _samples(registry.render().decode())
    gen = "playground:generation_tokens_total{}"
    prompt = "playground:prompt_tokens_total{}"
    assert after[gen] - before[gen] == 5
    assert after[prompt] - before[prompt] == 3
    ok = "playground:request_success_total{length}"
    assert after[ok] - before.get(ok, 0) == 1
    ttft = "playground:time_to_first_token_seconds_count{}"
    assert after[ttft] - before[ttft] == 1


# --- the step recorder, without a model ---------------------------------------------------------


class RecordingSink:
    """A MetricsSink that keeps what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe_step(self, step):
        self.calls.append(("step", step.step_index))

    def observe_finished(self, metrics, finish_reason):
        self.calls.append(("finished", finish_reason))

    def observe_prefix_cache(self, num_query_tokens, num_hit_tokens):
        self.calls.append(("prefix", num_query_tokens, num_hit_tokens))

    def observe_spec_decode(
        self, num_draft_tokens, num_accepted_tokens, num_drafts=0, accepted_by_position=()
    ):
        self.calls.append(("spec", num_draft_tokens, num_accepted_tokens))
        self.spec_details = (num_drafts, list(accepted_by_position))


def test_step_recorder_counts_steps_prefix_lookups_and_drafts():
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.request import Request
    from engine.telemetry.cost import ModelShape
    from engine.telemetry.recorder import StepRecorder

    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    shape = ModelShape(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                       num_kv_heads=2, head_dim=16, vocab_size=100,
                       tie_word_embeddings=True)  # fmt: skip
    sink = RecordingSink()
    recorder = StepRecorder(shape, sched, bm, sink, step_history_len=8, request_history_len=8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    request = Request("a", list(range(1, 9)), params, arrival_time=0.0, max_total_tokens=64)
    sched.add_request(request)

    out = sched.schedule()  # the 8-token prompt: a prefix lookup, nothing cached yet
    start = recorder.start_step(out, start_time=1.0)
    sched.update(out, {"a": [20]})
    prefill = recorder.record_step(start, out, {"a": [20]}, end_time=1.5)
    assert (prefill.kind, prefill.num_prefill_tokens, prefill.duration_s) == ("prefill", 8, 0.5)
    assert (prefill.num_prefix_query_tokens, prefill.num_prefix_hit_tokens) == (8, 0)
    assert prefill.flops > 0 and prefill.num_running == 1

    out = sched.schedule(drafts={"a": [21, 22, 23]})  # verify 3 drafts; 2 accepted + 1
    start = recorder.start_step(out, start_time=2.0)
    sched.update(out, {"a": [21, 22, 30]})
    decode = recorder.record_step(start, out, {"a": [21, 22, 30]}, end_time=2.25)
    assert (decode.kind, decode.num_decode_reqs, decode.num_decode_tokens) == ("decode", 1, 4)
    assert (decode.step_index, decode.num_draft_tokens, decode.num_accepted_tokens) == (1, 3, 2)

    recorder.record_finished("a", "length", request.metrics)
    assert recorder.num_steps == 2
    assert (recorder.num_draft_tokens_total, recorder.num_accepted_tokens_total) == (3, 2)
    # One request verified 3 drafts and kept the first 2: positions 0 and 1 accepted, 2 not.
    assert sink.spec_details == (1, [1, 1, 0])
    assert recorder.num_spec_proposals_total == 1
    assert recorder.num_draft_tokens_by_position == [1, 1, 1]
    assert recorder.num_accepted_tokens_by_position == [1, 1, 0]
    assert recorder.num_prefix_query_tokens_total == 8 and recorder.num_prefix_hit_tokens_total == 0
    assert [s.step_index for s in recorder.step_history.snapshot()] == [0, 1]
    assert [f.finish_reason for f in recorder.finished_history.snapshot()] == ["length"]
    assert sink.calls == [
        ("prefix", 8, 0), ("step", 0), ("spec", 3, 2), ("step", 1), ("finished", "length"),
    ]  # fmt: skip


def test_the_engine_records_nothing_in_prometheus_unless_its_caller_asks():
    from engine.core.engine import LLMEngine
    from engine.telemetry.prom import EngineMetricsRegistry
    from engine.telemetry.prom_null import NullMetricsRegistry

    config = EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=8)
    assert isinstance(LLMEngine(config).metrics_registry, NullMetricsRegistry)
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=8)
    assert isinstance(llm.engine.metrics_registry, EngineMetricsRegistry)
