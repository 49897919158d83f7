"""fp8 KV scales (EngineConfig.calculate_kv_scales, kv_scale_granularity): amax / 448 of the
first batch each layer stores, per tensor or per KV head, frozen after; values beyond 448 that
scale 1.0 would clamp come back within fp8's precision; both attention backends (Triton under
TRITON_INTERPRET=1); the bad-input errors. Format basics are in test_kv_quant.py."""

import pytest
import torch
from test_kv_quant import GREEDY, PROMPTS  # the agreement set of 16-bit vs int8/fp8

from benchmarks.kv_quant import tokens_before_divergence
from engine import LLM, EngineConfig
from engine.runner.attention import TorchBackend, TritonBackend
from engine.runner.attention.base import AttentionInputs, AttentionMetadata
from engine.runner.attention.cpu_backend import CpuBackend
from engine.runner.attention.kv_quant import (
    FP8_MAX,
    MIN_FP8_SCALE,
    LayerKVCache,
    calculate_fp8_scale_,
)

TINY64 = "random:tiny,head_dim=64"
BACKENDS = {"torch": TorchBackend, "triton": TritonBackend, "cpu": CpuBackend}
HEADS, HEAD_DIM, BLOCK = 2, 64, 8
FP8_RELATIVE = 2.0**-4  # e4m3 rounds to 3 mantissa bits: half a step is 2^-4 of the value


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"calculate_kv_scales": True}, "calculate_kv_scales: needs kv_cache_dtype='fp8'"),
        (
            {"calculate_kv_scales": True, "kv_cache_dtype": "int8"},
            "calculate_kv_scales: needs kv_cache_dtype='fp8'",
        ),
        ({"kv_cache_dtype": "fp8", "calculate_kv_scales": "yes"}, "calculate_kv_scales: must be"),
        ({"kv_cache_dtype": "fp8", "kv_scale_granularity": "head"}, "kv_scale_granularity: 'head'"),
        (
            {"kv_cache_dtype": "fp8", "calculate_kv_scales": True, "kv_scale_granularity": "row"},
            "kv_scale_granularity: must be one of tensor, head",
        ),
    ],
)
def test_bad_scale_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes)


def test_backend_refuses_calculated_scales_without_fp8():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="calculate_kv_scales: needs kv_cache_dtype='fp8'"):
        TorchBackend(2, 64, 8, torch.float32, cpu, "int8", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="kv_scale_granularity: must be one of"):
        TorchBackend(2, 64, 8, torch.float32, cpu, "fp8", kv_scale_granularity="row")


def test_scale_is_amax_over_valid_tokens_then_frozen():
    x = torch.randn(5, 3, 64) * torch.tensor([1.0, 10.0, 1000.0])[None, :, None]
    valid = torch.tensor([True, True, True, True, False])
    x[4] = 1e6  # a padding token (slot -1): stores nothing, so it must not set the scale
    amax_per_head = x[:4].abs().amax(dim=(0, 2))
    per_tensor, per_head = torch.zeros(3), torch.zeros(3)
    calculate_fp8_scale_(x, valid, per_tensor, per_head=False)
    calculate_fp8_scale_(x, valid, per_head, per_head=True)
    torch.testing.assert_close(per_tensor, (amax_per_head.max() / FP8_MAX).expand(3))
    torch.testing.assert_close(per_head, amax_per_head / FP8_MAX)
    # Frozen: a later, larger batch changes nothing (its blocks would disagree with older ones).
    before = per_tensor.clone(), per_head.clone()
    calculate_fp8_scale_(x * 100, valid, per_tensor, per_head=False)
    calculate_fp8_scale_(x * 100, valid, per_head, per_head=True)
    assert torch.equal(per_tensor, before[0]) and torch.equal(per_head, before[1])


def test_padding_only_batch_calculates_nothing_and_zeros_get_the_floor():
    scale = torch.zeros(2)
    calculate_fp8_scale_(torch.ones(3, 2, 64), torch.zeros(3, dtype=torch.bool), scale, True)
    assert not scale.any()  # a CUDA-graph capture's padding batch: still "not calculated"
    calculate_fp8_scale_(torch.zeros(3, 2, 64), torch.ones(3, dtype=torch.bool), scale, True)
    assert torch.equal(scale, torch.full((2,), MIN_FP8_SCALE))  # never a division by zero


def _store_prefill(backend, cache: LayerKVCache, q, k, v) -> torch.Tensor:
    """One prefill of len(k) tokens in blocks 0, 1, ... through backend.forward; returns the
    attention output [T, Hq, D] (Hq = Hkv)."""
    num_tokens = k.shape[0]
    slots = torch.arange(num_tokens)
    table = list(range(-(-num_tokens // BLOCK)))
    inputs = AttentionInputs(slots, [], [], [num_tokens], [num_tokens], [table], True)
    meta = backend.build_metadata(inputs, [cache])
    return backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)


def _stored(backend_name: str, cache: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The first n slots of a K or V cache dequantized: [n, Hkv, D] float32."""
    if backend_name in ("torch", "cpu"):  # head-major [Hkv, blocks, bs, D]
        values = cache.view(HEADS, -1, HEAD_DIM)[:, :n].transpose(0, 1)
    else:  # [blocks, bs, Hkv, D]
        values = cache.view(-1, HEADS, HEAD_DIM)[:n]
    return values.float() * scale[None, :, None]


def _reference_attention(q, k, v) -> torch.Tensor:
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        scale=HEAD_DIM**-0.5,
    )  # fmt: skip
    return o.transpose(0, 1)


@pytest.mark.parametrize("backend_name", ["torch", "triton", "cpu"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_calculated_scales_keep_values_beyond_448(backend_name, granularity):
    """K/V up to ~4000 (a third beyond 448; heads 30x apart): scale 1.0 clamps those; scales
    calculated from this first batch store every value within fp8's relative precision, so
    attention matches the unquantized one, and a later, larger batch leaves them as they are."""
    gen = torch.Generator().manual_seed(0)
    head_size = torch.tensor([30.0, 1000.0])[None, :, None]
    k = torch.randn(20, HEADS, HEAD_DIM, generator=gen) * head_size
    v = torch.randn(20, HEADS, HEAD_DIM, generator=gen) * head_size
    # Queries shrunk by the head's size: scores of order 1, not a one-hot softmax.
    q = torch.randn(20, HEADS, HEAD_DIM, generator=gen) / head_size
    results = {}
    for calculate in (False, True):
        backend = BACKENDS[backend_name](
            HEADS, HEAD_DIM, BLOCK, torch.float32, torch.device("cpu"), "fp8",
            calculate_kv_scales=calculate, kv_scale_granularity=granularity,
        )  # fmt: skip
        cache = backend.allocate_kv_caches(1, 4)[0]
        out = _store_prefill(backend, cache, q, k, v)
        results[calculate] = (backend, cache, out)
    backend, cache, out = results[True]
    amax_k, amax_v = k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))
    if granularity == "tensor":
        amax_k, amax_v = amax_k.max().expand(HEADS), amax_v.max().expand(HEADS)
    torch.testing.assert_close(cache.key_scale, amax_k / FP8_MAX)
    torch.testing.assert_close(cache.value_scale, amax_v / FP8_MAX)
    for x, stored, scale in ((k, cache.key, cache.key_scale), (v, cache.value, cache.value_scale)):
        back = _stored(backend_name, stored, scale, len(x))
        normal = (x / scale[None, :, None]).abs() >= 2**-6  # fp8 normals: relative precision
        assert ((back - x).abs()[normal] <= x.abs()[normal] * FP8_RELATIVE).all()
    _, fixed, fixed_out = results[False]
    assert _stored(backend_name, fixed.value, fixed.value_scale, 20).abs().max() == FP8_MAX
    # Attention over V: the calculated scales' output is close to the 16-bit one; 1.0's is not.
    ref = _reference_attention(q, k, v)
    calculated_error = ((out - ref).norm() / ref.norm()).item()
    fixed_error = ((fixed_out - ref).norm() / ref.norm()).item()
    assert calculated_error < 0.05 < fixed_error
    # Frozen: a second, 10x larger batch keeps the first batch's scales.
    before = cache.key_scale.clone(), cache.value_scale.clone()
    meta = AttentionMetadata(torch.arange(20), 0, calculate_kv_scales=True)
    backend.calculate_kv_scales_(k * 10, v * 10, cache, meta)
    assert torch.equal(cache.key_scale, before[0]) and torch.equal(cache.value_scale, before[1])


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_engine_scales_are_set_by_the_first_batch_and_kept(backend):
    """The whole engine on a tiny random model: a fresh pool's scales are 0 ("not calculated")
    even after the start-up profiling pass, the first request sets every layer's, and a later
    longer request (prefill and decodes) leaves them as they were; greedy tokens match the
    16-bit KV run on this short prompt."""
    common = dict(dtype="float32", num_kv_blocks=32, block_size=8, attention_backend=backend)
    llm = LLM(TINY64, kv_cache_dtype="fp8", calculate_kv_scales=True, **common)
    caches = llm.engine.runner.kv_caches
    assert all(not c.key_scale.any() and not c.value_scale.any() for c in caches)
    prompt = [(7 * i) % 900 + 5 for i in range(21)]
    tokens = llm.generate([prompt], GREEDY)[0].token_ids
    first = [(c.key_scale.clone(), c.value_scale.clone()) for c in caches]
    for key_scale, value_scale in first:
        assert (key_scale > 0).all() and (value_scale > 0).all()
        assert (key_scale == key_scale[0]).all()  # per tensor: one value over the heads
    llm.generate([[(11 * i) % 900 + 3 for i in range(40)]], GREEDY)
    assert all(
        torch.equal(c.key_scale, k) and torch.equal(c.value_scale, v)
        for c, (k, v) in zip(caches, first, strict=True)
    )
    reference = LLM(TINY64, **common).generate([prompt], GREEDY)[0].token_ids
    assert tokens == reference


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_greedy_agreement_with_calculated_scales(make_llm, llm_f32, granularity):
    """The embedded model in float32, 4 short prompts x 12 greedy tokens, fp8 with scales
    calculated from the first batch (all 4 prompts' prefill). As with scale 1.0
    (test_kv_quant.py): e4m3's 3 mantissa bits flip near-ties, so the bar is a rate."""
    reference = [o.token_ids for o in llm_f32.generate(PROMPTS, GREEDY)]
    llm = make_llm(dtype="float32", max_model_len=512, kv_cache_dtype="fp8",
                   calculate_kv_scales=True, kv_scale_granularity=granularity)  # fmt: skip
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert [t[0] for t in tokens] == [t[0] for t in reference]
    num_tokens = sum(len(t) for t in reference)
    assert tokens_before_divergence(reference, tokens) >= 0.4 * num_tokens
