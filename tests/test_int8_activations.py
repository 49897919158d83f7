"""EngineConfig.int8_activations: the W8A8 / W4A8 kernels (kernels/cpu_int8_act_linear.h)
against the exact arithmetic they promise, the row switch, and the engine's int8 and int4 layers
running them (prompt log-probabilities close to the weight-only path's, but not equal: the int8
path ran)."""

from __future__ import annotations

import pytest
import torch
from fused_close import int4_weight

from benchmarks import quant as bench_quant
from engine import LLM, EngineConfig, SamplingParams
from engine.config import ANY_ROWS, INT8_ACTIVATIONS_MIN_ROWS, INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS
from engine.runner.models.prepack import cpu_has_amx
from engine.runner.quant.formats import quantize_int8
from engine.runner.quant.linear import QuantLinear
from kernels import cpu_fused_ops


def _w4a8_kernel() -> None:
    if cpu_fused_ops.cpu_fused_ops_status() is not None:
        pytest.skip("the C++ kernels are unavailable (no compiler)")
    if not (cpu_fused_ops.has_int4_linear() and cpu_fused_ops.has_int8_act_linear()):
        pytest.skip("the W4A8 kernel needs AVX512-VNNI, BW and VBMI (and the bf16 int4 kernel)")


def _int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel multiplies it: per row and group, round(x / a) * a with a = max|x| / 127
    (round half to even, as vcvtps2dq), in float64."""
    m, k = x.shape
    xg = x.double().view(m, k // group, group)
    a = (xg.abs().amax(-1, keepdim=True).float() / 127).double()  # float32 in the kernel
    q = torch.round(xg.float() * torch.where(a > 0, 1 / a.float(), 0)).double()
    return (q * a).view(m, k)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group"),
    # tiles of 4 rows and the 1-3 row tails; groups 32-128; SmolLM2's 576 and 1536 inputs;
    # several 64-row blocks per thread (the next block's prefetch).
    [(16, 64, 64, 32), (17, 576, 576, 64), (18, 960, 576, 64), (19, 128, 1536, 128),
     (64, 3072, 576, 64), (33, 192, 1536, 32)],
)  # fmt: skip
def test_w4a8_matches_its_int8_rows_times_the_weight(rows, n, k, group):
    """Above the switch: x quantized per group, times the int4 weight, exactly in int32 and
    then scaled; the reference (float64) differs by float32 epilogue sums and the bf16 out."""
    _w4a8_kernel()
    gen = torch.Generator().manual_seed(rows * 131 + n + k + group)
    packed, scale_and_zero, w = int4_weight(n, k, group, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, :group] = 0  # an all-zero group: scale 0, no NaN
    out = cpu_fused_ops.int4_linear(x, packed, scale_and_zero, group, 16)
    w = w.double()
    ref = _int8_rows(x, group) @ w.T
    tol = 1e-2 * ref.abs().max().item()  # ~2 bf16 steps of the largest output
    assert (out.double() - ref).abs().max().item() < tol
    # And what it costs against the bf16 activations (the weight-only product): ~0.6% here.
    exact = x.double() @ w.T
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    # tiles of 6 rows and their tails; SmolLM2's 576 / 1536 inputs; several blocks per thread.
    [(4, 64, 64), (7, 576, 576), (17, 960, 576), (64, 3072, 576), (33, 576, 1536)],
)
def test_w8a8_matches_its_int8_rows_times_the_weight(rows, n, k):
    """int8 weights: x quantized per 64 inputs times q (exact in int32), scaled per group and
    by the row's scale."""
    _w4a8_kernel()
    gen = torch.Generator().manual_seed(rows * 17 + n + k)
    w8 = quantize_int8(torch.randn(n, k, generator=gen) * 0.05)
    scales = w8.scales.bfloat16()
    w = w8.qweight.double() * scales.double()[:, None]
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[-1, 64:128] = 0
    out = cpu_fused_ops.int8_linear(x, w8.qweight, scales, 4)
    ref = _int8_rows(x, 64) @ w.T
    assert (out.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    exact = x.double() @ w.T
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02
    # Below the switch the weight-only kernel, bit for bit.
    few = x[:3].contiguous()
    weight_only = cpu_fused_ops.int8_linear(few, w8.qweight, scales)
    assert torch.equal(cpu_fused_ops.int8_linear(few, w8.qweight, scales, 4), weight_only)


def test_below_the_switch_the_weight_only_kernel_runs():
    _w4a8_kernel()
    gen = torch.Generator().manual_seed(7)
    packed, scale_and_zero, _ = int4_weight(192, 576, 64, gen)
    for rows in (1, 4, 15):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        a8 = cpu_fused_ops.int4_linear(x, packed, scale_and_zero, 64, 16)
        assert torch.equal(a8, cpu_fused_ops.int4_linear(x, packed, scale_and_zero, 64))
    x = torch.randn(16, 576, generator=gen).bfloat16()
    a8 = cpu_fused_ops.int4_linear(x, packed, scale_and_zero, 64, 16)
    assert not torch.equal(a8, cpu_fused_ops.int4_linear(x, packed, scale_and_zero, 64))


def test_config_needs_quantized_weights():
    for quantization in ("int8", "int4", "awq"):
        EngineConfig(quantization=quantization, int8_activations=True)
    with pytest.raises(ValueError, match="int8_activations: needs quantized weights"):
        EngineConfig(int8_activations=True)


ENGINE = dict(
    model="random:tiny", dtype="bfloat16", max_model_len=128, num_kv_blocks=48, block_size=8,
    quantization_group_size=32, fused_ops=True,
)  # fmt: skip
PROMPT = [(37 * i) % 900 + 3 for i in range(40)]  # 40 tokens: a prefill of many rows
SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
SWITCH = {"int8": INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS, "int4": INT8_ACTIVATIONS_MIN_ROWS}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_layers_run_int8_activations(quantization):
    _w4a8_kernel()
    if cpu_has_amx():
        pytest.skip("with AMX tiles the weight-only kernels stay (int8_activations warns)")
    weight_only = LLM(**ENGINE, quantization=quantization)
    a8 = LLM(**ENGINE, quantization=quantization, int8_activations=True)
    switch = SWITCH[quantization]
    assert a8.engine.runner.quant_summary.int8_activations_min_rows == switch
    assert weight_only.engine.runner.quant_summary.int8_activations_min_rows == 0
    layers = [m for m in a8.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.int8_activations_min_rows == switch for m in layers)

    def prompt_logprobs(llm: LLM) -> torch.Tensor:
        out = llm.generate([PROMPT], SCORE)[0]
        return torch.tensor([lp.logprob for lp in out.prompt_logprobs if lp])

    ref, got = prompt_logprobs(weight_only), prompt_logprobs(a8)
    assert got.shape == ref.shape and not torch.equal(got, ref)  # the int8 path ran
    assert (got - ref).abs().mean().item() < 0.1 * ref.abs().mean().item()
    # Below the switch (a 3-token prefill, then batch-1 decode) the weight-only kernel runs in
    # both engines: the same greedy tokens.
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short = PROMPT[:3]
    assert a8.generate([short], few)[0].token_ids == weight_only.generate([short], few)[0].token_ids


def test_the_roofline_takes_the_int8_roof_where_it_has_one():
    from engine.telemetry.ceilings import PRESETS, DeviceCeilings
    from playground.handlers.roofline import roof_dtype

    measured = DeviceCeilings("cpu", {"bfloat16": 4e11, "int8": 8.5e11}, 5e10, True, "measured")
    assert roof_dtype(measured, "int8", "bfloat16")[0] == "int8"
    assert "Compute roof: int8 products" in roof_dtype(measured, "int8", "bfloat16")[1]
    assert roof_dtype(measured, "bfloat16", "bfloat16") == ("bfloat16", "")
    # A datasheet GPU (or a roof cached before int8 peaks were measured): the model dtype's
    # peak, said so.
    dtype, note = roof_dtype(PRESETS["H200"], "int8", "bfloat16")
    assert dtype == "bfloat16" and note.startswith("**No int8 peak in this roof**")
    assert "Re-measure" not in note  # a datasheet roof
    old = DeviceCeilings("cpu", {"bfloat16": 4e11}, 5e10, True, "measured before int8")
    assert "(Re-measure adds it)" in roof_dtype(old, "int8", "bfloat16")[1]


def test_engine_stats_name_the_matmul_dtype():
    _w4a8_kernel()
    if cpu_has_amx():
        pytest.skip("with AMX tiles the weight-only kernels stay")
    assert LLM(**ENGINE, quantization="int4").stats().matmul_dtype == "bfloat16"
    a8 = LLM(**ENGINE, quantization="int4", int8_activations=True)
    assert a8.stats().matmul_dtype == "int8"
    assert "every step in one C++ call" in a8.stats().layer_ops
    # Every row count: the layers' few-row limit, the decode step's, and bench-quant's field.
    layers = [m for m in a8.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert all(m.dequant_min_rows == m.few_rows_max == ANY_ROWS for m in layers)
    assert a8.engine.runner.model.decode_step.max_rows == ANY_ROWS
    assert bench_quant.dequant_rows(ANY_ROWS) == "never" and bench_quant.dequant_rows(65) == 65


def test_chunked_prefill_with_int8_activations_scores_like_weight_only():
    """A 40-token prompt in chunks of 16 (a token budget of 16): each chunk after the first
    attends to the cache the earlier ones wrote, through the same C++ step that now takes
    every step; its log-probabilities stay as close to the weight-only engine's as unchunked."""
    _w4a8_kernel()
    if cpu_has_amx():
        pytest.skip("with AMX tiles the weight-only kernels stay")
    chunked = {**ENGINE, "quantization": "int4", "max_num_batched_tokens": 16}
    ref = LLM(**chunked).generate([PROMPT], SCORE)[0].prompt_logprobs
    got = LLM(**chunked, int8_activations=True).generate([PROMPT], SCORE)[0].prompt_logprobs
    ref = torch.tensor([lp.logprob for lp in ref if lp])
    got = torch.tensor([lp.logprob for lp in got if lp])
    assert got.shape == ref.shape == (len(PROMPT) - 1,)
    assert (got - ref).abs().mean().item() < 0.1 * ref.abs().mean().item()


def test_without_the_cpp_kernels_it_warns_and_stays_weight_only(caplog):
    """fused_ops=False (the torch "before"; on CUDA the Triton kernels): no W8A8 there, said
    in the log, and nothing claims it ran."""
    with caplog.at_level("WARNING", logger="engine.runner.model_build"):
        llm = LLM(**{**ENGINE, "fused_ops": False}, quantization="int4", int8_activations=True)
    assert "int8_activations: runs with the C++ CPU kernels only" in caplog.text
    assert llm.engine.runner.quant_summary.int8_activations_min_rows == 0
    assert llm.stats().matmul_dtype == "bfloat16"
