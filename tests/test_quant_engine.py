"""EngineConfig.quantization in the engine: validation, which layers are quantized and what
stays 16-bit, greedy output equal to a plain-torch model holding the same dequantized weights
(float32, tiny random model), and the cost model's bytes per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, EngineConfig, SamplingParams
from engine.runner.quant.linear import QuantLinear

TINY = {"model": "random:tiny", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256}


def test_config_validates_quantization_fields():
    assert EngineConfig().quantization == "none"
    EngineConfig(quantization="int4", quantization_group_size=128)  # shapes are checked at load
    with pytest.raises(ValueError, match="quantization: must be one of none, int8, int4"):
        EngineConfig(quantization="int2")
    for bad in (48, 0, True, "64"):
        with pytest.raises(ValueError, match="quantization_group_size"):
            EngineConfig(quantization_group_size=bad)


def test_group_size_not_dividing_in_features_names_the_field():
    # The tiny model's hidden size is 64: a group of 128 does not fit its q/k/v projection.
    with pytest.raises(ValueError, match="quantization_group_size: 128 does not divide"):
        LLM(**TINY, quantization="int4", quantization_group_size=128)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, make_llm):
    return make_llm(**TINY, quantization=request.param, quantization_group_size=32)


def test_every_linear_and_the_lm_head_are_quantized(quantized):
    model = quantized.engine.runner.model
    quant = [name for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * len(model.layers) + 1 and "lm_head" in quant
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # What stays 16-bit (here float32): the embedding (tied: the LM head got its own copy).
    assert model.embed_tokens.weight.dtype == torch.float32
    summary = quantized.engine.runner.quant_summary
    expected = {"int8": 1.0, "int4": 0.5}[quantized.config.quantization]
    # Stored bytes per weight: the values plus float32 scales (and zeros) per row or group.
    assert expected < summary.linear_bytes_per_param < expected + 0.3
    assert quantized.engine.runner.weight_bytes == summary.total_bytes


def _plain_torch_twin(quantized: LLM, **config: object) -> LLM:
    """The same tiny model unquantized, its linears and an untied LM head set to the
    quantized engine's dequantized weights: F.linear in float32 everywhere."""
    twin = LLM(**TINY, **config)  # same seed: same embedding and norms
    src, dst = quantized.engine.runner.model, twin.engine.runner.model
    with torch.no_grad():
        for (name, q), (name2, lin) in zip(
            [(n, m) for n, m in src.named_modules() if isinstance(m, QuantLinear)][:-1],
            [(n, m) for n, m in dst.named_modules() if isinstance(m, nn.Linear)],
            strict=True,
        ):
            assert name == name2
            lin.weight.copy_(q.dequantized_weight())
        n, k = src.lm_head.out_features, src.lm_head.in_features
        head = nn.Linear(k, n, bias=False, device=dst.embed_tokens.weight.device)
        head.weight.copy_(src.lm_head.dequantized_weight())
        dst.lm_head = head.requires_grad_(False)
    return twin


def test_greedy_output_equals_plain_torch_with_dequantized_weights(quantized):
    """70 prompts of 3..80 tokens: prefill chunks and a 70-row decode batch take the
    dequantize path (>= 64 rows), smaller decode batches and the LM head the kernel."""
    twin = _plain_torch_twin(quantized)
    prompts = [[(7 * i + j) % 49152 for j in range(3 + i)] for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    c = quantized.config
    engine = LLM(**TINY, quantization=c.quantization, quantization_group_size=32, max_num_seqs=70)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    want = [o.token_ids for o in twin.generate(prompts, params)]
    assert got == want
    small = [o.token_ids for o in quantized.generate(prompts[:3], params)]
    assert small == want[:3]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_no_quantize_lm_head_keeps_the_head_16_bit(method, make_llm):
    """--no-quantize-lm-head: the decoder linears quantized, the tied head still the embedding
    table (no copy); greedy output equals the plain model with only those linears dequantized,
    and the cost model reads the head at the model dtype."""
    c = {**TINY, "quantization": method, "quantization_group_size": 32}
    keep = LLM(**c, quantize_lm_head=False)
    model = keep.engine.runner.model
    assert model.lm_head is None
    quant = [name for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * len(model.layers) and "lm_head" not in quant
    twin = LLM(**TINY)  # its weights are changed below: not a shared engine
    with torch.no_grad():
        for q, lin in zip(
            [m for m in model.modules() if isinstance(m, QuantLinear)],
            [m for m in twin.engine.runner.model.modules() if isinstance(m, nn.Linear)],
            strict=True,
        ):
            lin.weight.copy_(q.dequantized_weight())
    prompts = [[(11 * i + j) % 49152 for j in range(3 + 5 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in keep.generate(prompts, params)]
    assert got == [o.token_ids for o in twin.generate(prompts, params)]
    head_bytes = model.embed_tokens.weight.numel() * 4
    summary, shape = keep.engine.runner.quant_summary, keep.engine.shape
    assert shape.weight_bytes == summary.linear_bytes + head_bytes + shape.norm_params * 4
    full = make_llm(**c).engine.shape
    assert full.weight_bytes < shape.weight_bytes


def test_cost_model_counts_quantized_bytes(quantized, make_llm):
    base = make_llm(**TINY).engine.shape
    shape = quantized.engine.shape
    ratio = shape.weight_bytes / base.weight_bytes
    # float32 baseline: int8 ~ 1/4, int4 g32 ~ 1/8 (+ scales, zeros, float32 norms).
    assert {"int8": 0.25, "int4": 0.125}[quantized.config.quantization] < ratio < 0.4


def test_weight_bytes_split_quantized_linears_from_16_bit_norms():
    from engine.runner.models.presets import MODEL_PRESETS
    from engine.telemetry.cost import ModelShape

    arch = MODEL_PRESETS["smollm2-135m"]
    bf16 = ModelShape.from_arch(arch, 2.0)
    int4 = ModelShape.from_arch(arch, 2.0, linear_bytes_per_param=0.5625)
    linear = bf16.num_linear_params_per_token  # layers + the (tied) LM head, read once
    assert bf16.weight_bytes == 2.0 * (linear + bf16.norm_params)
    assert int4.weight_bytes == 0.5625 * linear + 2.0 * bf16.norm_params


def test_a_cpu_with_another_int4_layout_always_dequantizes(monkeypatch, make_llm):
    """Where aten packs int4 differently (AVX2 builds), the engine must not hand our bytes to
    the CPU kernel: every call dequantizes, and greedy output stays that of the same weights."""
    import engine.runner.quant.apply as apply

    quantized = make_llm(**TINY, quantization="int4", quantization_group_size=32)

    monkeypatch.setattr(apply, "cpu_int4_layout_matches", lambda: False)
    fallback = LLM(**TINY, quantization="int4", quantization_group_size=32)
    assert fallback.engine.runner.quant_summary.dequant_min_rows == 0
    prompts = [[(5 * i + j) % 49152 for j in range(4 + i)] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in fallback.generate(prompts, params)]
    assert got == [o.token_ids for o in quantized.generate(prompts, params)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_cuda_greedy_output_equals_plain_torch_with_dequantized_weights(method):
    """On CUDA quantized calls below CUDA_DEQUANT_MIN_ROWS rows take the Triton weight-only
    kernels (float32 here: no TF32), decode steps under CUDA graphs; the tokens must be those
    of the same weights in float32."""
    from engine.runner.quant.apply import CUDA_DEQUANT_MIN_ROWS

    cuda = {"device": "cuda", "max_num_seqs": 8}
    quantized = LLM(**TINY, **cuda, quantization=method, quantization_group_size=32)
    assert quantized.engine.runner.quant_summary.dequant_min_rows == CUDA_DEQUANT_MIN_ROWS
    twin = _plain_torch_twin(quantized, **cuda)
    prompts = [[(7 * i + j) % 49152 for j in range(3 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in quantized.generate(prompts, params)]
    assert got == [o.token_ids for o in twin.generate(prompts, params)]
