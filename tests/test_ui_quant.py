"""Quantization in the playground (issue 13) at the handler level: the header and the KV
calculator show the loaded engine's weight format and bytes; Compare takes quantization on
both sides, has bf16-vs-int8/int4 presets, and rows for weight memory and greedy agreement."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from engine import EngineConfig
from engine.config import INT8_ACTIVATIONS_MIN_ROWS, INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS
from engine.runner.models.presets import MODEL_PRESETS
from engine.telemetry.cost import ModelShape
from playground.engine_info import EngineInfo, describe
from playground.handlers.compare import SideOutcome, compare_rows
from playground.handlers.compare_engine import (
    AWQ_PRESET,
    INT8_ACTIVATIONS_PRESET,
    LM_HEAD_PRESET,
    PRESET_DEFAULTS,
    PRESETS,
    preset_form,
    side_config,
    side_label,
)
from playground.handlers.kv import LOADED_MODEL, formula_markdown, parse_inputs
from playground.loadgen import LoadTestResult, RequestResult, WorkloadSpec

INT4 = EngineConfig(quantization="int4", quantization_group_size=64)
SHAPE = ModelShape.from_arch(MODEL_PRESETS["smollm2-135m"], linear_bytes_per_param=0.5625)


def _info(config: EngineConfig = INT4, weight_bytes: int = 132_338_304) -> EngineInfo:
    return EngineInfo("smollm2-135m", config, SHAPE, "cpu", "bfloat16", 1024, 64, 1 << 20,
                      weight_bytes)  # fmt: skip


def test_header_names_the_format_what_stays_16_bit_and_the_bytes():
    header = describe(_info())
    assert "int4 weight-only (round-to-nearest, a scale and zero per 64 inputs)" in header
    assert "LM head int4; the embedding, norms and biases stay bfloat16: 132.3 MB" in header
    plain = describe(_info(EngineConfig(), 269_030_016))
    assert "matmul weights bfloat16: 269.0 MB" in plain
    awq = describe(_info(EngineConfig(quantization="awq"), 75_000_000))
    assert "int4 from an AutoAWQ checkpoint in every decoder linear layer, LM head int4 " in awq
    assert "round-to-nearest (not in the checkpoint); the embedding, norms and biases" in awq
    assert "weights: AutoAWQ checkpoint of the Q4_1 GGUF (embedded" in awq
    kept = describe(_info(EngineConfig(quantization="awq", quantize_lm_head=False), 116_400_000))
    assert "decoder linear layer; the embedding, norms, biases and LM head stay bfloat16" in kept


def test_kv_loaded_model_counts_the_engines_stored_weight_bytes():
    x = parse_inputs(LOADED_MODEL, "as the model", 512, 1, "bf16 / fp16 (2 B)",
                  "fp32 (4 B)", "H100 SXM 80GB", 0.9, _info())  # fmt: skip
    assert x.weights_bytes == 132_338_304  # not params x the form's 4 B
    assert "weights: the loaded engine's own, 132.3 MB as stored (matmul weights int4" in (
        formula_markdown(x)
    )


def _outcome(name: str, tokens: list[list[int]], temperature: float, weight_bytes: int):
    spec = WorkloadSpec(num_prompts=len(tokens), temperature=temperature)
    per_request = []
    for i, ids in enumerate(tokens):
        r = RequestResult(i, send_time=0.0, first_token_time=0.1, prompt_tokens=8)
        r.token_times = [0.1 * (k + 1) for k in range(len(ids))]
        r.end_time, r.output_tokens, r.output_token_ids = r.token_times[-1], len(ids), ids
        per_request.append(r)
    run = LoadTestResult(spec, "engine:x", 0.0, 1.0, per_request)
    return SideOutcome(name, f"{name}: x", INT4, result=run, runs=[run], weight_bytes=weight_bytes)


def test_compare_rows_weight_memory_and_greedy_agreement():
    a = _outcome("A", [[1, 2, 3, 4], [5, 6, 7, 8]], 0.0, 269_030_016)
    b = _outcome("B", [[1, 2, 3, 9], [5, 6, 7, 8]], 0.0, 132_338_304)
    rows = {r[0]: r for r in compare_rows(a, b)}
    assert rows["Weight memory (MB, as stored)"][1:5] == ["269.03", "132.34", "x0.49", "B"]
    assert rows["Output tokens same as A (%, greedy runs)"][1:3] == ["100.00", "87.50"]
    sampled = _outcome("B", [[1, 2, 3, 4], [5, 6, 7, 8]], 0.8, 132_338_304)
    rows = {r[0]: r for r in compare_rows(a, sampled)}
    assert rows["Output tokens same as A (%, greedy runs)"][1:3] == ["n/a", "n/a"]


def test_quantization_presets_and_side_configs():
    for name, fmt in (("bf16 vs int8 weights", "int8"), ("bf16 vs int4 weights", "int4")):
        assert name in PRESETS
        form = preset_form(name)
        a, b = form["A"], form["B"]
        assert (a["quantization"], b["quantization"]) == ("none", fmt)
        assert form["workload"]["temperature"] == 0.0  # greedy: the agreement row applies
        base = EngineConfig(model="random:tiny")
        assert side_config(base, b, 1024, 256, head_dim=64).quantization == fmt
        assert side_config(base, a, 1024, 256, head_dim=64).quantization == "none"
        assert side_label("B", b, a) == f"B: quantization={fmt}"
    awq = preset_form(AWQ_PRESET)  # bf16 vs int4 RTN vs AWQ: the second of two runs
    assert (awq["A"]["quantization"], awq["B"]["quantization"]) == ("int4", "awq")
    assert PRESET_DEFAULTS[AWQ_PRESET].headline.startswith("Held-out perplexity")
    other = preset_form("max_num_seqs 2 vs 8")
    assert other["A"]["quantization"] == other["B"]["quantization"] == "none"
    assert other["A"]["quantize_lm_head"] and other["B"]["quantize_lm_head"]
    head = preset_form(LM_HEAD_PRESET)
    a, b = head["A"], head["B"]
    assert a["quantization"] == b["quantization"] == "awq"
    assert (a["quantize_lm_head"], b["quantize_lm_head"]) == (False, True)
    base = EngineConfig(model="random:tiny")
    assert not side_config(base, a, 1024, 256, head_dim=64).quantize_lm_head
    assert side_config(base, b, 1024, 256, head_dim=64).quantize_lm_head
    assert side_label("A", a, b) == "A: quantize_lm_head=False"


def test_int8_activations_preset_side_configs_and_header():
    form = preset_form(INT8_ACTIVATIONS_PRESET)
    a, b = form["A"], form["B"]
    assert a["quantization"] == b["quantization"] == "int4"
    assert (a["int8_activations"], b["int8_activations"]) == (False, True)
    assert a["max_num_seqs"] == b["max_num_seqs"] == 32 == form["workload"]["num_prompts"]
    base = EngineConfig(model="random:tiny")
    assert side_config(base, b, 1024, 256, head_dim=64).int8_activations
    assert not side_config(base, a, 1024, 256, head_dim=64).int8_activations
    assert side_label("B", b, a) == "B: int8_activations=True"
    other = preset_form("max_num_seqs 2 vs 8")
    assert not other["A"]["int8_activations"] and not other["B"]["int8_activations"]
    with pytest.raises(ValueError, match="int8_activations: needs quantized weights"):
        side_config(base, {**a, "quantization": "none", "int8_activations": True}, 1024, 256,
                    head_dim=64)  # fmt: skip
    header = describe(_info(EngineConfig(quantization="int4", int8_activations=True)))
    assert (
        f"(activations rounded to int8 per group from {INT8_ACTIVATIONS_MIN_ROWS} rows on CPUs "
        "with AVX512-VNNI: W4A8)" in (header)
    )
    header = describe(_info(EngineConfig(quantization="int8", int8_activations=True)))
    assert (
        f"from {INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS} rows on CPUs with AVX512-VNNI: W8A8)" in header
    )


def test_info_fields_are_what_engine_info_reads():
    from playground.engine_info import describe, engine_info

    stats = SimpleNamespace(num_kv_blocks=64, kv_cache_bytes=1 << 20, kv_cache_dtype="bfloat16",
                            attention_backend="cpu", layer_ops="cpu (fused C++ ops)",
                            matmul_dtype="int8")  # fmt: skip
    service = SimpleNamespace(model_name="m", config=INT4, model_shape=SHAPE, device="cpu",
                              dtype="bfloat16", max_model_len=1024, weight_bytes=123,
                              stats=lambda: stats)  # fmt: skip
    info = engine_info(service)
    assert (info.weight_bytes, info.kv_cache_dtype) == (123, "bfloat16")
    assert info.attention_backend == "cpu"
    assert info.layer_ops == "cpu (fused C++ ops)"
    assert info.matmul_dtype == "int8"  # the roofline's compute roof
    assert "attention cpu, norm/RoPE/SiLU cpu (fused C++ ops)" in describe(info)


def test_compare_sides_score_held_out_perplexity_through_the_engine():
    """Each engine side scores the same held-out window through its prompt logprobs: int8
    weights cost perplexity, and the row says so (lower is better)."""
    from engine.serving.service import EngineService
    from playground.handlers.compare_engine import PERPLEXITY_WINDOW_TOKENS, held_out_perplexity

    tiny = dict(model="random:tiny", dtype="float32", num_kv_blocks=64, max_model_len=512)
    scores = {}
    for fmt in ("none", "int8"):
        service = EngineService(EngineConfig(**tiny, quantization=fmt))
        try:
            scores[fmt] = held_out_perplexity(service)
        finally:
            service.shutdown()
    assert PERPLEXITY_WINDOW_TOKENS == 256
    assert scores["none"] > 1 and scores["int8"] > 1 and scores["none"] != scores["int8"]
    a = _outcome("A", [[1, 2]], 0.0, 269_030_016)
    b = _outcome("B", [[1, 2]], 0.0, 191_582_592)
    a.perplexity, b.perplexity = 15.25, 23.02
    rows = {r[0]: r for r in compare_rows(a, b)}
    assert rows["Held-out perplexity (256 tokens of pydoc text)"][1:5] == [
        "15.25", "23.02", "x1.51", "A"
    ]  # fmt: skip


def test_header_names_fp8_kv_scales():
    fixed = EngineConfig(kv_cache_dtype="fp8")
    header = describe(dataclasses.replace(_info(fixed), kv_cache_dtype="float8_e4m3fn"))
    assert "MiB of fp8 (e4m3) K/V, scales 1.0 (paged" in header
    per_head = fixed.replace(calculate_kv_scales=True, kv_scale_granularity="head")
    assert "scales per layer and KV head from the first batch" in describe(_info(per_head))
    per_layer = fixed.replace(calculate_kv_scales=True)
    assert "scales per layer from the first batch" in describe(_info(per_layer))
    assert "scales" not in describe(_info(EngineConfig(kv_cache_dtype="int8")))
