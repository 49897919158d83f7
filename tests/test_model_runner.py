"""ModelRunner pieces that run at start-up on a GPU, exercised on the CPU."""

from __future__ import annotations

import pytest

from engine import LLM


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_forward_leaves_the_cache_alone(backend):
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=8, max_model_len=128,
              attention_backend=backend)  # fmt: skip
    runner = llm.engine.runner
    before = runner.kv_caches
    runner.profile_forward(40)  # the activation probe CUDA start-up runs before sizing the KV
    assert runner.kv_caches is before
    assert llm.generate([[5, 6, 7]])[0].finished
