"""The fused per-layer Triton ops (kernels/fused_ops_triton.py, the GPU path of
EngineConfig.fused_ops) under TRITON_INTERPRET=1 against their torch reference (layer_ops
TorchOps): the kernels round where torch's op sequence rounds, so the residual sum and RoPE are
bit-exact and RMSNorm / SiLU differ at most by a neighbouring 16-bit value (summation order,
exp's last float32 bit). The interpreter truncates float32 -> bfloat16 (a GPU rounds to
nearest even, as torch does), so bit-exactness is checked in float32 and float16 and bfloat16
within a neighbouring value. In the engine: the same greedy tokens as the torch ops, and the ops the
engine picks on CUDA."""

from __future__ import annotations

import pytest
import torch
from fused_close import DTYPES, assert_close

import engine.runner.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.runner.models.arch import ModelArch
from engine.runner.models.layer_ops import TorchOps, TritonFusedOps, make_layer_ops

REF = TorchOps()
FUSED = TritonFusedOps()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 576])  # 96: a masked tail of the 128-wide block
def test_rms_norm_and_residual_add_match_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(5, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, width, generator=gen).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    assert_close(FUSED.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5), dtype)
    expected_out, expected_residual = REF.add_rms_norm(x, residual, weight, 1e-5)
    in_place = residual.clone()
    out, new_residual = FUSED.add_rms_norm(x, in_place, weight, 1e-5)
    assert new_residual is in_place  # the stream is updated where it lives
    if dtype == torch.bfloat16:  # the interpreter's truncation (see the module docstring)
        assert_close(in_place, expected_residual, dtype)
    else:
        assert torch.equal(in_place, expected_residual)  # one rounding of the same sum: exact
    assert_close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_heads_in_place_bit_exact_and_leaves_v(dtype):
    gen = torch.Generator().manual_seed(3)
    head_dim, rotated, total_heads = 64, 5, 7  # 5 heads: a masked tail of the 8-head tile
    wide = torch.randn(7, total_heads * head_dim + 40, generator=gen).to(dtype)
    qkv = wide[:, : total_heads * head_dim]  # a strided view, as the model's qkv slices are
    positions = torch.tensor([0, 3, 39, 5, 5, 17, 1])
    freqs = torch.outer(torch.arange(40).float(), torch.rand(head_dim // 2, generator=gen) + 0.1)
    cos, sin = freqs.cos(), freqs.sin()
    expected = REF.rope(qkv, REF.rope_tables(positions, cos, sin, dtype), rotated, head_dim)
    before = wide.clone()
    out = FUSED.rope(qkv, FUSED.rope_tables(positions, cos, sin, dtype), rotated, head_dim)
    assert out.data_ptr() == qkv.data_ptr()
    if dtype == torch.bfloat16:  # the interpreter's truncation (see the module docstring)
        assert_close(out, expected, dtype)
    else:
        assert torch.equal(out, expected)
    assert torch.equal(wide[:, rotated * head_dim :], before[:, rotated * head_dim :])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100): inf, silu 0
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_over_the_whole_range(dtype):
    gen = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.randn(4, 1536, generator=gen) * 4, torch.full((1, 1536), -100.0),
                      torch.full((1, 1536), 100.0)])  # fmt: skip
    up = torch.randn(6, 1536, generator=gen)  # 1536: two 1024-wide blocks, the second masked
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    assert_close(FUSED.silu_mul(gate_up), REF.silu_mul(gate_up), dtype)


def test_bad_inputs_are_refused_naming_the_argument():
    with pytest.raises(AssertionError, match="x must be"):
        FUSED.rms_norm(torch.randn(2, 32), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="residual"):
        FUSED.add_rms_norm(torch.randn(2, 64), torch.randn(3, 64), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="power of two"):
        FUSED.rope(torch.randn(2, 96), (torch.tensor([0, 1]), torch.ones(4, 24),
                                        torch.zeros(4, 24)), 2, 48)  # fmt: skip


def test_cuda_models_get_the_triton_ops_unless_switched_off():
    arch = ModelArch.from_hf_config(
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    )  # fmt: skip
    cuda = torch.device("cuda")
    assert make_layer_ops(True, cuda, arch)[0].name == "triton"
    assert make_layer_ops(False, cuda, arch)[0].name == "torch"
    odd = ModelArch.from_hf_config(
        {"hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    )  # fmt: skip
    ops, why = make_layer_ops(True, cuda, odd)  # head_dim 24: half 12 is not a power of two
    assert ops.name == "torch" and "head_dim 24" in why


def test_engine_tokens_match_the_torch_ops(monkeypatch):
    """The whole decoder with the Triton ops (interpreted on CPU) against the torch ops."""
    prompts = [[(5 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate([6, 23, 3])]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    common = dict(model="random:tiny", dtype="float32", num_kv_blocks=32, block_size=8,
                  max_model_len=64, enforce_eager=True)  # fmt: skip
    reference = [o.token_ids for o in LLM(fused_ops=False, **common).generate(prompts, params)]
    monkeypatch.setattr(model_runner, "make_layer_ops", lambda *a: (TritonFusedOps(), None))
    llm = LLM(fused_ops=True, **common)
    assert llm.stats().layer_ops == "triton (fused Triton ops)"
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_cuda_is_bit_exact_against_torch():
    """On a GPU (float32 -> bfloat16 rounds to nearest there) every op equals torch's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(64, 576, generator=gen, **bf16) * 3
    residual = torch.randn(64, 576, generator=gen, **bf16)
    weight = torch.randn(576, generator=gen, **bf16)
    expected_out, expected_residual = REF.add_rms_norm(x, residual, weight, 1e-5)
    out, got_residual = FUSED.add_rms_norm(x, residual.clone(), weight, 1e-5)
    assert torch.equal(got_residual, expected_residual) and torch.equal(out, expected_out)
    qkv = torch.randn(64, 15 * 64, generator=gen, **bf16)
    positions = torch.randint(0, 2048, (64,), generator=gen, device="cuda")
    freqs = torch.outer(torch.arange(2048, device="cuda").float(), torch.rand(32, device="cuda"))
    tables = (positions, freqs.cos(), freqs.sin())
    expected = REF.rope(qkv, REF.rope_tables(*tables, qkv.dtype), 12, 64)
    assert torch.equal(FUSED.rope(qkv.clone(), FUSED.rope_tables(*tables, qkv.dtype), 12, 64),
                       expected)  # fmt: skip
    gate_up = torch.randn(64, 2 * 1536, generator=gen, **bf16) * 4
    assert torch.equal(FUSED.silu_mul(gate_up), REF.silu_mul(gate_up))
