"""The fused per-layer CPU ops (kernels/cpu_fused_ops.cpp) against their torch reference
(engine/runner/models/layer_ops.py TorchOps), and in the engine: the same greedy tokens with the
switch on and off, fewer torch ops per step with it on, and a stated fallback without them."""

from __future__ import annotations

import logging

import pytest
import torch
from fused_close import DTYPES, assert_close, int4_weight

from engine import LLM, SamplingParams
from engine.runner.models.layer_ops import CpuFusedOps, TorchOps
from engine.runner.models.prepack import cpu_has_bf16_dot
from kernels import cpu_fused_ops

REF = TorchOps()


@pytest.fixture(scope="module")
def fused() -> CpuFusedOps:
    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    return CpuFusedOps()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 96 takes the multi-threaded path
def test_rms_norm_and_residual_add_match_torch(fused, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    assert_close(fused.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5), dtype)
    expected_out, expected_residual = REF.add_rms_norm(x, residual, weight, 1e-5)
    in_place = residual.clone()
    out, new_residual = fused.add_rms_norm(x, in_place, weight, 1e-5)
    assert new_residual is in_place  # the stream is updated where it lives
    assert torch.equal(in_place, expected_residual)  # one rounding of the same sum: exact
    assert_close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: the scalar tail (half not a multiple of 16)
def test_rope_rotates_q_and_k_heads_in_place_and_leaves_v(fused, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    rows, rotated, total_heads, positions_len = 7, 5, 7, 40
    qkv = torch.randn(rows, total_heads * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 39, 5, 5, 17, 1])
    freqs = torch.outer(torch.arange(positions_len).float(), torch.rand(head_dim // 2) + 0.1)
    cos, sin = freqs.cos(), freqs.sin()
    expected = REF.rope(qkv, REF.rope_tables(positions, cos, sin, dtype), rotated, head_dim)
    before = qkv.clone()
    out = fused.rope(qkv, fused.rope_tables(positions, cos, sin, dtype), rotated, head_dim)
    assert out.data_ptr() == qkv.data_ptr()  # a view of the rotated buffer
    assert_close(out, expected, dtype)
    assert torch.equal(qkv[:, rotated * head_dim :], before[:, rotated * head_dim :])


def test_rope_reads_a_strided_view_and_rejects_positions_outside_the_table(fused):
    wide = torch.randn(3, 200)
    view = wide[:, :128]  # row stride 200: the kernel honours it
    cos, sin = torch.ones(8, 32), torch.zeros(8, 32)  # the identity rotation
    before = wide.clone()
    fused.rope(view, (torch.tensor([0, 1, 7]), cos, sin), 2, 64)
    assert torch.equal(wide, before)
    with pytest.raises(ValueError, match="positions: 8 is outside"):
        fused.rope(view, (torch.tensor([0, 8, 1]), cos, sin), 2, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_over_the_whole_range(fused, dtype):
    gen = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.randn(4, 64, generator=gen) * 4, torch.full((1, 64), -100.0),
                      torch.full((1, 64), 100.0)])  # fmt: skip
    up = torch.randn(6, 64, generator=gen)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    assert_close(fused.silu_mul(gate_up), REF.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torch_argmax_with_its_tie_and_nan_rules(fused, dtype):
    """Greedy sampling's argmax on the head's own dtype: the first index of the max (ties, a
    flat row, two infinities), a NaN counting as the max (the first NaN), a row of -inf giving
    0, and widths with a scalar tail (49155 = 16 x 3072 + 3)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 49155, generator=gen)
    x[0, 5] = x[0, 40000] = 50.0
    x[1, 7] = x[1, 49154] = float("nan")
    x[2] = 0.0
    x[3, 100] = x[3, 200] = float("inf")
    x[4] = float("-inf")
    x[5, 49153] = 60.0  # the max in the tail
    x[6] = torch.randint(0, 3, (49155,), generator=gen).float()
    x = x.to(dtype)
    expected = x.float().argmax(dim=-1)
    assert torch.equal(fused.argmax_rows(x), expected)
    assert torch.equal(REF.argmax_rows(x), expected)
    for width in (1, 15, 16, 17):
        narrow = x[:, :width].contiguous()
        assert torch.equal(fused.argmax_rows(narrow), narrow.float().argmax(dim=-1))


def test_bad_inputs_raise_value_errors_naming_the_argument(fused):
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight: contiguous"):
        fused.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="x: width must be a multiple of 16"):
        fused.rms_norm(torch.randn(2, 40), torch.ones(40), 1e-5)
    with pytest.raises(ValueError, match="residual: contiguous"):
        fused.add_rms_norm(x, torch.randn(3, 64), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused.rms_norm(x.double(), torch.ones(64).double(), 1e-5)
    with pytest.raises(ValueError, match="gate_up: width must be a multiple of 32"):
        fused.silu_mul(torch.randn(2, 48))


# --- in the engine ---


def _count_rows(monkeypatch, name: str) -> list[int]:
    """Wrap cpu_fused_ops.<name> (a product taking x first) to record each call's rows."""
    calls: list[int] = []
    kernel = getattr(cpu_fused_ops, name)

    def counting(x, *args):
        calls.append(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(cpu_fused_ops, name, counting)
    return calls


PROMPTS = [[(5 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate([6, 23, 3, 40])]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
COMMON = dict(
    model="random:tiny", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=48,
    block_size=8, max_model_len=128,
)  # fmt: skip


def test_engine_tokens_match_with_fused_ops_on_and_off(fused):
    results = {}
    for on in (False, True):
        llm = LLM(fused_ops=on, **COMMON)
        assert llm.engine.runner.layer_ops.name == ("cpu" if on else "torch")
        results[on] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert llm.stats().layer_ops == ("cpu (fused C++ ops)" if on else "torch")
    assert results[True] == results[False]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layers_dequantize_in_one_pass_with_the_fused_ops(fused, quantization):
    """The C++ dequantization moves the weight-only kernel's crossover down (apply.py)."""
    from engine.runner.quant.apply import CPU_DEQUANT_MIN_ROWS, CPU_FUSED_DEQUANT_MIN_ROWS
    from engine.runner.quant.linear import QuantLinear, cpu_int4_layout_matches

    # 0: this CPU's aten int4 kernel packs another way, so every call dequantizes.
    no_kernel = quantization == "int4" and not cpu_int4_layout_matches()
    for on in (True, False):
        runner = LLM(quantization=quantization, fused_ops=on, **COMMON).engine.runner
        layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
        rows = CPU_FUSED_DEQUANT_MIN_ROWS if on else CPU_DEQUANT_MIN_ROWS[quantization]
        rows = 0 if no_kernel else rows
        assert runner.quant_summary.dequant_min_rows == rows
        assert all(m.dequant_min_rows == rows for m in layers)
        assert all((m.cpu_kernels is not None) is on for m in layers)


def test_int8_decode_runs_the_cpp_kernel_with_the_same_tokens(fused, monkeypatch):
    """With the fused ops, int8 layers' few-row calls go to cpu_fused_ops.int8_linear (not
    aten's kernel), and greedy float32 tokens are those of the torch path."""
    calls = _count_rows(monkeypatch, "int8_linear")
    results = {}
    for on in (False, True):
        llm = LLM(quantization="int8", fused_ops=on, **COMMON)
        results[on] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert bool(calls) is on
    assert results[True] == results[False]
    assert 1 in calls and max(calls) < llm.engine.runner.quant_summary.dequant_min_rows


def _torch_ops_of_one_prefill_step(llm: LLM) -> int:
    from torch.profiler import ProfilerActivity, profile

    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0))
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def test_fused_ops_cut_the_torch_ops_of_a_step(fused):
    """The mechanism the speed comes from (timings belong to benchmarks.batch1): per layer,
    RMSNorm's ~9 ops, RoPE's ~10 and SiLU-and-mul's 3 become one call each."""
    unfused = _torch_ops_of_one_prefill_step(LLM(fused_ops=False, **COMMON))
    llm = LLM(fused_ops=True, **COMMON)
    fused_count = _torch_ops_of_one_prefill_step(llm)
    num_layers = llm.engine.runner.arch.num_layers
    # Measured ~75 fewer per layer of random:tiny (nested ops counted).
    assert unfused - fused_count >= 50 * num_layers, (fused_count, unfused)


def test_without_the_extension_the_torch_ops_run_and_say_why(monkeypatch, caplog):
    from kernels.cpu_build import CpuKernelUnavailable

    def unavailable():
        raise CpuKernelUnavailable("no C++ compiler (test)")

    monkeypatch.setattr(cpu_fused_ops, "load_extension", unavailable)
    with caplog.at_level(logging.WARNING):
        llm = LLM(fused_ops=True, **COMMON)
    assert llm.engine.runner.layer_ops.name == "torch"
    assert "fused_ops: the torch ops run instead: no C++ compiler (test)" in caplog.text
    assert llm.stats().layer_ops == "torch (fused ops unavailable: no C++ compiler (test))"
    assert len(llm.generate(PROMPTS[:1], PARAMS)[0].token_ids) == PARAMS.max_tokens


def test_compare_preset_and_side_config_switch_the_fused_ops():
    from engine import EngineConfig
    from playground.handlers.compare_engine import (
        FUSED_OPS_PRESET,
        PRESET_DEFAULTS,
        preset_sides,
        side_config,
        side_label,
    )

    a, b = preset_sides(FUSED_OPS_PRESET)
    base = EngineConfig(model="random:tiny", dtype="bfloat16")
    assert side_config(base, a, 1024, 256, head_dim=64).fused_ops is False
    assert side_config(base, b, 1024, 256, head_dim=64).fused_ops is True
    assert side_label("B", b, a) == "B: fused_ops=True"
    assert PRESET_DEFAULTS[FUSED_OPS_PRESET].headline == "Mean TPOT (ms)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 200), (3, 7), (17, 64)])  # n % 4: the row tail
def test_int8_linear_matches_the_dequantized_matmul(fused, dtype, rows, n):
    """W8A16 for decode's few rows against x @ (q * s).T in float32: only the summation order
    and the output's rounding differ."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 96
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(n, generator=gen) * 0.02 + 0.001).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    ref = (x.float() @ (q.float() * s.float()[:, None]).T).to(dtype)
    assert_close(cpu_fused_ops.int8_linear(x, q, s), ref, dtype)


# rows: across the switch to cpu_int8_rows.h's dot products at 5 (6: a partial tile of x rows;
# without AVX512-BF16 the float32 blocks from 13: 17 a tile of 5 rows after 2 of 6)
# and to its x-lanes path at 32 (33: a zero-padded last x vector; 100: a second pass over each
# weight row group); n: 16-row groups, one or several per thread.
@pytest.mark.parametrize("rows", [3, 4, 5, 6, 12, 13, 17, 31, 32, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(80, 96), (128, 96), (192, 576)])
def test_int8_linear_takes_many_bf16_rows(fused, rows, n, k):
    """bfloat16 x with whole 16-row groups: the few-row kernel up to 4 rows, dot products over
    the widened weight rows (cpu_int8_rows.h) from 5, x as the per-lane operand from 32 (without
    AVX512-BF16: the few-row kernel up to 12 rows, then 64-row blocks widened to float32); all
    against x @ (q * s).T in float32."""
    if not cpu_fused_ops.has_int8_rows_linear():
        pytest.skip("cpu_int8_rows.h needs AVX-512 (the few-row kernel takes every row)")
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0, :] = -127  # the extremes convert exactly too
    q[1, :] = 127
    s = (torch.rand(n, generator=gen) * 0.02 + 0.001).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ref = (x.float() @ (q.float() * s.float()[:, None]).T).bfloat16()
    assert_close(cpu_fused_ops.int8_linear(x, q, s), ref, torch.bfloat16)


def test_int8_bf16_layers_take_a_batch_64_step_with_the_kernel(fused, monkeypatch):
    """With the many-row kernels (cpu_int8_rows.h), bfloat16 int8 layers multiply up to 64 rows with
    int8_linear instead of dequantizing into a scratch for oneDNN (AMX CPUs keep 32)."""
    if not cpu_fused_ops.has_int8_rows_linear():
        pytest.skip("cpu_int8_rows.h needs AVX-512")
    from engine.runner.quant.apply import (
        CPU_FUSED_DEQUANT_MIN_ROWS,
        CPU_INT8_ROWS_KERNEL_DEQUANT_MIN_ROWS,
    )
    from engine.runner.quant.linear import Int8Linear

    calls = _count_rows(monkeypatch, "int8_linear")
    llm = LLM(quantization="int8", fused_ops=True, **{**COMMON, "dtype": "bfloat16"})
    llm.engine.runner.model.decode_step = None  # the Python layers: their calls are counted
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
    expected = _many_rows_switch(CPU_INT8_ROWS_KERNEL_DEQUANT_MIN_ROWS)
    assert all(m.rows_kernel and m.dequant_min_rows == expected for m in layers)
    out = llm.generate(PROMPTS, PARAMS)  # prefill chunks of up to 32 tokens, then 4-row decodes
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in out)
    assert 1 in calls and 4 in calls
    if expected > CPU_FUSED_DEQUANT_MIN_ROWS:
        assert max(calls) >= CPU_FUSED_DEQUANT_MIN_ROWS  # a 32-token chunk: no dequantize


def _many_rows_switch(without_amx: int) -> int:
    """The rows from which bfloat16 quantized layers dequantize: `without_amx` on CPUs with
    AVX512-BF16 and no AMX (the vdpbf16ps kernels take a batch-64 step); never (ANY_ROWS)
    without AVX512-BF16, where oneDNN's bf16 GEMM is emulated; on AMX CPUs
    CPU_AMX_DEQUANT_MIN_ROWS with the AMX kernels, else CPU_FUSED_DEQUANT_MIN_ROWS (oneDNN's
    AMX GEMM)."""
    from engine.config import ANY_ROWS
    from engine.runner.models.prepack import cpu_has_amx, cpu_has_bf16_dot
    from engine.runner.quant.apply import CPU_AMX_DEQUANT_MIN_ROWS, CPU_FUSED_DEQUANT_MIN_ROWS

    if not cpu_has_bf16_dot():
        return ANY_ROWS
    if not cpu_has_amx():
        return without_amx
    return (
        CPU_AMX_DEQUANT_MIN_ROWS if cpu_fused_ops.has_amx_linear() else CPU_FUSED_DEQUANT_MIN_ROWS
    )


def _amx_kernels(fused) -> None:
    if not cpu_fused_ops.has_amx_linear():
        pytest.skip("cpu_amx_linear.h needs a CPU with AMX-BF16 (and Linux's permission)")


# rows: 4 and 6 (the switches to AMX), 16 (one full tile), 17 and 100 (a zero-padded last
# tile), 64 (a batch-64 step: four accumulator tiles), 65 (a second pass over the weight rows).
AMX_ROWS = [4, 6, 16, 17, 64, 65, 100]


@pytest.mark.parametrize("rows", AMX_ROWS)
@pytest.mark.parametrize(("n", "k"), [(80, 96), (192, 576), (64, 1536)])  # 80: 16-row groups
def test_amx_int8_linear_matches_the_dequantized_matmul(fused, rows, n, k):
    """AMX W8A16 (cpu_amx_linear.h: weight rows widened to bfloat16 exactly, x as pairs,
    tdpbf16ps) against x @ (q * s).T in float32."""
    _amx_kernels(fused)
    gen = torch.Generator().manual_seed(rows * 31 + n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0, :], q[1, :] = -127, 127  # the extremes convert exactly too
    s = (torch.rand(n, generator=gen) * 0.02 + 0.001).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ref = (x.float() @ (q.float() * s.float()[:, None]).T).bfloat16()
    assert_close(cpu_fused_ops.int8_linear(x, q, s), ref, torch.bfloat16)


# From 9 rows cpu_int4_linear.h dequantizes each 64-row block once into bfloat16 pairs and runs
# the bf16 kernel's loop over them (without AVX512-BF16 from 13, into float32); AMX does the
# same from 6 rows. kernels/cpu_int4_linear.h: DEQUANTIZED_PAIRS_MIN_M.
INT4_DEQUANTIZED_PAIRS_MIN_ROWS = 9 if cpu_has_bf16_dot() else 13


@pytest.mark.parametrize("rows", [6, 9, 13, 17, 64, 100])
@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (192, 576, 64), (128, 1536, 128)])
def test_int4_linear_many_rows_multiply_the_one_pass_dequantized_weight(fused, rows, n, k, group):
    """With many rows W4A16 (vdpbf16ps from 9, float32 from 13, AMX from 6) multiplies the
    bfloat16 weights dequant_int4 writes ((q - 8) * s + zf rounded once; its multiply-add may
    round a weight to the neighbouring bfloat16), so it equals x @ that weight up to float32 summation order: within
    one bfloat16 rounding of the output, and most elements bit-equal."""
    _int4_kernel(fused)
    if rows < INT4_DEQUANTIZED_PAIRS_MIN_ROWS and not cpu_fused_ops.has_amx_linear():
        pytest.skip("below the switch: the nibbles' own products (the test below)")
    gen = torch.Generator().manual_seed(rows * 7 + n + k + group)
    packed, scale_and_zero, _ = int4_weight(n, k, group, gen)
    wt = torch.empty(k, n, dtype=torch.bfloat16)
    cpu_fused_ops.dequant_int4(wt, packed, scale_and_zero, group, 0, n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ref = (x.float() @ wt.float()).bfloat16()
    out = cpu_fused_ops.int4_linear(x, packed, scale_and_zero, group)
    assert_close(out, ref, torch.bfloat16)
    assert (out == ref).float().mean() > 0.9


def test_int8_linear_rejects_mismatched_inputs(fused):
    x, q, s = torch.randn(2, 32), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match="qweight"):
        cpu_fused_ops.int8_linear(x, q[:, :16], s)
    with pytest.raises(ValueError, match="qweight"):
        cpu_fused_ops.int8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="scales"):
        cpu_fused_ops.int8_linear(x, q, s.bfloat16())
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_fused_ops.int8_linear(torch.randn(2, 24), torch.zeros(8, 24, dtype=torch.int8), s)
    with pytest.raises(ValueError, match=r"x: CPU \[rows, cols\] with a contiguous last dim"):
        cpu_fused_ops.int8_linear(torch.randn(2, 64)[:, ::2], q, s)


def _int4_kernel(fused) -> None:
    if not cpu_fused_ops.has_int4_linear():
        pytest.skip("int4_linear needs AVX-512 with VBMI (aten's kernel runs instead)")


@pytest.mark.parametrize(
    ("rows", "n", "k", "group"),
    # rows: 1 (decode), 2 and 3 (odd tiles), 4 (one full tile), 5 (two tiles over the nibbles),
    # 9, 17 and 64 (tiles of 4 over a block's dequantized pairs); groups 32-128; SmolLM2's shapes
    # (576 = 9 x 64, 1536) and several 64-row blocks per thread.
    [(1, 64, 64, 32), (1, 576, 576, 64), (2, 960, 576, 64), (3, 128, 1536, 128),
     (5, 1536, 576, 32), (9, 192, 576, 64), (4, 3072, 576, 64), (17, 320, 1536, 128),
     (64, 576, 576, 64)],
)  # fmt: skip
def test_int4_linear_matches_the_dequantized_matmul(fused, rows, n, k, group):
    """W4A16 (cpu_int4_linear.h) against x @ W.T in float32 with W dequantized from the same
    nibbles and (s, zf): only the summation order and the bfloat16 output's rounding differ."""
    _int4_kernel(fused)
    gen = torch.Generator().manual_seed(rows * 7919 + n + k + group)
    packed, scale_and_zero, w = int4_weight(n, k, group, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ref = (x.float() @ w.T).bfloat16()
    out = cpu_fused_ops.int4_linear(x, packed, scale_and_zero, group)
    assert_close(out, ref, torch.bfloat16)
    if rows < INT4_DEQUANTIZED_PAIRS_MIN_ROWS:
        # Up to 4 rows the kernel multiplies the float32 weight: most elements round to the
        # reference's bfloat16 exactly (the rest to a neighbour). More rows multiply the weight
        # rounded to bfloat16, as dequantize + GEMM does (the test above).
        assert (out == ref).float().mean() > 0.9


def test_int4_linear_rejects_mismatched_inputs(fused):
    _int4_kernel(fused)
    packed, sz, _ = int4_weight(64, 64, 32, torch.Generator().manual_seed(0))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="x: bfloat16"):
        cpu_fused_ops.int4_linear(x.float(), packed, sz, 32)
    with pytest.raises(ValueError, match="packed"):
        cpu_fused_ops.int4_linear(torch.randn(1, 128).bfloat16(), packed, sz, 32)
    with pytest.raises(ValueError, match="N a multiple of 64"):
        cpu_fused_ops.int4_linear(x, packed[:48], sz[:, :48].contiguous(), 32)
    with pytest.raises(ValueError, match="group_size"):
        cpu_fused_ops.int4_linear(x, packed, sz, 24)
    with pytest.raises(ValueError, match="scale_and_zero"):
        cpu_fused_ops.int4_linear(x, packed, sz.float(), 32)


def test_int4_bf16_decode_runs_the_cpp_kernel(fused, monkeypatch):
    """bfloat16 int4 layers' few-row calls go to cpu_fused_ops.int4_linear when the CPU has
    it, and each layer's output is aten's kernel's within bfloat16 rounding."""
    _int4_kernel(fused)
    from engine.runner.quant.linear import Int4Linear

    calls = _count_rows(monkeypatch, "int4_linear")
    llm = LLM(quantization="int4", fused_ops=True, **{**COMMON, "dtype": "bfloat16"})
    out = llm.generate(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in out)
    assert 1 in calls and max(calls) < llm.engine.runner.quant_summary.dequant_min_rows
    layer = next(m for m in llm.engine.runner.model.modules() if isinstance(m, Int4Linear))
    assert layer.bf16_kernel
    # Up to a batch-64 step through the kernel (it reuses a block's pairs across rows); on AMX
    # CPUs up to CPU_AMX_DEQUANT_MIN_ROWS with the AMX tiles (without them: dequantize + GEMM).
    from engine.runner.quant.apply import CPU_INT4_KERNEL_DEQUANT_MIN_ROWS

    expected = _many_rows_switch(CPU_INT4_KERNEL_DEQUANT_MIN_ROWS)
    assert layer.dequant_min_rows == expected
    x = torch.randn(3, layer.in_features).bfloat16()
    aten = torch._weight_int4pack_mm_for_cpu(
        x, layer.packed, layer.group_size, layer.scale_and_zero
    )
    assert_close(layer(x), aten, torch.bfloat16)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_few_row_steps_call_the_bound_kernels_with_the_module_paths_tokens(fused, quantization):
    """With the fused ops every bfloat16 layer binds its products' few-row kernels
    (llama.LayerCalls): steps of few tokens call them without going through the linear
    modules, and give the tokens the module path gives (same kernels, same arguments)."""
    if quantization == "int4":
        _int4_kernel(fused)
    config = {**COMMON, "dtype": "bfloat16", "quantization": quantization}
    llm = LLM(fused_ops=True, **config)
    # The layers' own path; the one-call C++ step over the same kernels has its own tests
    # (tests/test_cpu_decode_step.py).
    llm.engine.runner.model.decode_step = None
    layers = llm.engine.runner.model.layers
    if quantization == "none" and layers[0].self_attn.o_proj.few_rows is None:
        # With AMX, oneDNN packs a 64-row weight (this tiny model's o_proj) in another layout
        # than the packed kernel reads: those layers keep oneDNN, and nothing binds.
        pytest.skip("oneDNN packs this model's 64-row weights in another layout on this CPU")
    assert all(layer.few_row_calls is not None for layer in layers)
    attn = layers[0].self_attn
    assert layers[0].few_row_calls.qkv is attn.qkv_proj.few_rows  # the linear's own kernel
    module_calls = []
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "few_rows"):
            module.register_forward_hook(lambda *args: module_calls.append(1))
    short = [p[:3] for p in PROMPTS]  # every step (prefills too) within the kernels' rows
    bound = [o.token_ids for o in llm.generate(short, PARAMS)]
    # Only the LM head (compute_logits) still goes through its module.
    assert len(module_calls) <= PARAMS.max_tokens
    for layer in layers:
        layer.few_row_calls = None  # the module path, as with many rows
    module_calls.clear()
    assert [o.token_ids for o in llm.generate(short, PARAMS)] == bound
    assert len(module_calls) > 4 * len(layers) * PARAMS.max_tokens
    # Without the C++ ops there are no few-row kernels to bind, and enforce_eager (the
    # "before") leaves them unbound: the modules run, with the same tokens.
    torch_layers = LLM(fused_ops=False, **config).engine.runner.model.layers
    assert all(layer.few_row_calls is None for layer in torch_layers)
    eager = LLM(fused_ops=True, enforce_eager=True, **config)
    assert all(layer.few_row_calls is None for layer in eager.engine.runner.model.layers)
    assert [o.token_ids for o in eager.generate(short, PARAMS)] == bound


def test_compare_preset_switches_the_direct_kernel_calls():
    from engine import EngineConfig
    from playground.handlers.compare_engine import (
        EAGER_PRESET,
        PRESET_DEFAULTS,
        preset_sides,
        side_config,
        side_label,
    )

    a, b = preset_sides(EAGER_PRESET)
    base = EngineConfig(model="random:tiny", dtype="bfloat16", enforce_eager=True)
    assert side_config(base, a, 1024, 256, head_dim=64).enforce_eager is True
    assert side_config(base, b, 1024, 256, head_dim=64).enforce_eager is False
    assert side_label("B", b, a) == "B: enforce_eager=False"
    assert PRESET_DEFAULTS[EAGER_PRESET].headline == "Mean TPOT (ms)"
