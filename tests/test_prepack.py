"""Linear weights prepacked for oneDNN (engine/runner/models/prepack.py): the same numbers as
F.linear, bit for bit, and the engine's tokens and logprobs unchanged with the switch on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.models.prepack import (
    PrepackedLinear,
    can_prepack,
    packed_gemv_max_rows,
    packed_layout_matches,
    prepack_linears,
)

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN packs no bf16 weights here (no oneDNN bf16, or a CPU without AVX512-BF16: "
    "there the pairs layout is ours, tests/test_prepack_pairs.py)",
)


@pytest.mark.parametrize("num_rows", [1, 3, 16, 64, 512])
def test_prepacked_linear_is_bit_identical_to_f_linear(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(96, 80, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(num_rows, 80, generator=gen).bfloat16()
    assert torch.equal(PrepackedLinear(w, b)(x), F.linear(x, w, b))
    assert torch.equal(PrepackedLinear(w, None)(x), F.linear(x, w))


def test_prepack_replaces_every_linear_and_packs_a_tied_head():
    from engine.runner.models.presets import MODEL_PRESETS

    model = _tiny_model(MODEL_PRESETS["tiny"])
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    tied = model.lm_head is None
    x = torch.randint(0, model.arch.vocab_size, (5,))
    hidden = model.embed_tokens(x)
    before = model.compute_logits(hidden)
    assert prepack_linears(model) == len(linears) + tied
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PrepackedLinear)
    assert torch.equal(model.compute_logits(hidden), before)


def _tiny_model(arch):
    from engine.runner.attention import get_backend
    from engine.runner.models.llama import LlamaForCausalLM

    backend = get_backend("torch")(arch.num_kv_heads, arch.head_dim, 16, torch.bfloat16,
                                   torch.device("cpu"), "auto")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch, 64, backend).to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def test_engine_tokens_and_logprobs_unchanged_by_prepacking():
    from engine import LLM, SamplingParams

    prompts = [[11, 12, 13, 14, 15], list(range(100, 140)), [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for prepack in (False, True):
        # fused_ops off: oneDNN at every row count (the few-row C++ kernel sums in another
        # order; tests below).
        llm = LLM(model="random:tiny", dtype="bfloat16", prepack_weights=prepack, seed=3,
                  fused_ops=False)  # fmt: skip
        packed = llm.engine.runner.num_prepacked_linears
        assert (packed > 0) is prepack
        results[prepack] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert results[True] == results[False]


def test_float32_and_the_off_switch_leave_the_weights_alone():
    from engine import LLM

    assert not can_prepack(torch.device("cpu"), torch.float32)
    llm = LLM(model="random:tiny", dtype="float32")
    assert llm.engine.runner.num_prepacked_linears == 0
    plain = LLM(model="random:tiny", dtype="bfloat16", prepack_weights=False).engine.runner
    packed = LLM(model="random:tiny", dtype="bfloat16").engine.runner
    # Same weights, plus the packed copy of the tied head (the embedding keeps its own).
    head = packed.model.lm_head.packed_weight
    extra = head.numel() * head.element_size() if plain.model.lm_head is None else 0
    assert packed.weight_bytes == plain.weight_bytes + extra


def test_compare_preset_and_side_config_switch_prepacking():
    from engine import EngineConfig
    from playground.handlers.compare_engine import (
        PREPACK_PRESET,
        preset_sides,
        side_config,
        side_label,
    )

    a, b = preset_sides(PREPACK_PRESET)
    base = EngineConfig(model="random:tiny", dtype="bfloat16")
    assert side_config(base, a, 1024, 256, head_dim=64).prepack_weights is False
    assert side_config(base, b, 1024, 256, head_dim=64).prepack_weights is True
    assert side_label("B", b, a) == "B: prepack_weights=True"


def _packed_gemv_or_skip():
    from kernels import cpu_fused_ops

    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    if not packed_layout_matches(128, 96, torch.bfloat16):
        pytest.skip("oneDNN packs bf16 weights in another layout on this CPU (no AVX512-BF16)")
    return cpu_fused_ops


# > 4: tiles of 4 rows, or AMX tiles (16 rows, a partial last one) where the CPU has them
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 17, 64, 100, 256])
# (128, 576), not (64, 576): with AMX, oneDNN packs a 64-row weight in another layout (the
# layout check refuses it there, and oneDNN takes every row count).
@pytest.mark.parametrize(("n", "k"), [(128, 96), (128, 576), (192, 32)])
def test_few_rows_read_the_packed_weight_in_place(num_rows, n, k):
    """packed_bf16_linear against the float32 product of the same bf16 values: only the
    summation order and the output's rounding differ (so within a bf16 rounding or two)."""
    kernels = _packed_gemv_or_skip()
    gen = torch.Generator().manual_seed(num_rows * 100 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(num_rows, k, generator=gen).bfloat16()
    layer = PrepackedLinear(w, b, kernels)
    assert layer.gemv_kernels is kernels  # the layout check passed for this shape
    ref = x.float() @ w.float().T
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, n)
    # Two roundings to bf16 (the product, then the bias added to it); the reference in float32.
    err = (got.float() - (ref + b.float())).abs().max().item()
    assert err <= 2**-7 * max(ref.abs().max().item(), 1.0)
    # Above the kernel's rows: oneDNN, bit for bit as F.linear.
    many = torch.randn(layer.few_rows_max + 1, k, generator=gen).bfloat16()
    assert torch.equal(layer(many), F.linear(many, w, b))


def test_the_layout_check_refuses_what_the_kernel_cannot_read():
    assert not packed_layout_matches(100, 96, torch.bfloat16)  # N not a multiple of 64
    assert not packed_layout_matches(128, 95, torch.bfloat16)  # odd K
    assert not packed_layout_matches(192, 34, torch.bfloat16)  # K padded (oneDNN: to 32s)
    assert not packed_layout_matches(128, 96, torch.float16)
    layer = PrepackedLinear(torch.randn(100, 96).bfloat16(), None, kernels=object())
    assert layer.gemv_kernels is None  # oneDNN for every row count


def test_engine_decode_steps_use_the_packed_gemv(monkeypatch):
    """With the fused ops and prepacking on (the CPU defaults), a batch-1 decode step's linears
    go through packed_bf16_linear (and a prefill of up to 8 tokens); off, none do."""
    from engine import LLM, SamplingParams

    kernels = _packed_gemv_or_skip()
    calls = []
    original = kernels.packed_bf16_linear

    def counting(x, *args):
        calls.append(x.shape[0])
        return original(x, *args)

    monkeypatch.setattr(kernels, "packed_bf16_linear", counting)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = {}
    for fused in (False, True):
        calls.clear()
        llm = LLM(model="random:tiny", dtype="bfloat16", fused_ops=fused, seed=3)
        # The Python layers, whose kernel calls can be counted: the one-call C++ step calls the
        # same kernels (bit-identical, tests/test_cpu_decode_step.py).
        llm.engine.runner.model.decode_step = None
        outputs[fused] = llm.generate([[11, 12, 13, 14, 15]], params)[0].token_ids
        assert bool(calls) is fused
    # Decode's 1 row, and the 5-token prompt's prefill where the kernel takes 5 rows (not on
    # AMX CPUs whose extension lacks tiles: there oneDNN's GEMM wins from 5 rows).
    assert set(calls) == ({1, 5} if packed_gemv_max_rows(kernels) >= 5 else {1})
    assert len(outputs[True]) == len(outputs[False]) == 4
