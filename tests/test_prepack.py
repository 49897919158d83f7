"""Linear weights prepacked for oneDNN (engine/runner/models/prepack.py): the same numbers as
F.linear, bit for bit, and the engine's tokens and logprobs unchanged with the switch on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.models.prepack import PrepackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="this CPU or torch build has no oneDNN bfloat16 linear",
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
        llm = LLM(model="random:tiny", dtype="bfloat16", prepack_weights=prepack, seed=3)
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
