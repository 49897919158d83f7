"""The engine's own accounting: KV bytes match the formula, step intensities land where the
roofline says they should, and the Prometheus series move as requests run."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
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
