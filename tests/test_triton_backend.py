"""The engine on the Triton kernels (CPU, TRITON_INTERPRET=1) gives the torch path's tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

# Mixed lengths so one batch has whole prefills, chunks (budget 24) and decodes.
PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 40, 3, 29])]


@pytest.mark.slow
def test_triton_backend_matches_torch_backend():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    common = dict(
        model="random:tiny", dtype="float32", max_num_batched_tokens=24, num_kv_blocks=32,
        block_size=8, max_model_len=128,
    )  # fmt: skip
    torch_out = LLM(attention_backend="torch", **common).generate(PROMPTS, params)
    triton_llm = LLM(attention_backend="triton", **common)
    assert triton_llm.engine.runner.attn_backend.name == "triton"
    triton_out = triton_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    assert any(s.kind == "mixed" for s in triton_llm.stats().steps)
    stats = triton_llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
