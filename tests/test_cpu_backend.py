"""attention_backend="cpu" (the C++ paged kernel) in the engine: the torch path's tokens on a
mixed batch (whole prompts, chunks, decodes), over 16-bit and quantized pools; and the torch
fallback, said out loud, when the kernel cannot be built."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.runner.attention.cpu_backend import CpuAttentionMetadata
from kernels import cpu_attention

# Mixed lengths so one batch has whole prefills, chunks (budget 24) and decodes.
PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 40, 3, 29])]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
COMMON = dict(
    model="random:tiny", dtype="float32", max_num_batched_tokens=24, num_kv_blocks=32,
    block_size=8, max_model_len=128,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _needs_compiler():
    if (why := cpu_attention.cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_cpu_backend_matches_torch_backend(kv_cache_dtype):
    torch_out = LLM(attention_backend="torch", kv_cache_dtype=kv_cache_dtype, **COMMON).generate(
        PROMPTS, PARAMS
    )
    llm = LLM(attention_backend="cpu", kv_cache_dtype=kv_cache_dtype, **COMMON)
    backend = llm.engine.runner.attn_backend
    assert backend.name == "cpu" and backend.fallback_reason is None
    cpu_out = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in cpu_out] == [o.token_ids for o in torch_out]
    stats = llm.stats()
    assert any(s.kind == "mixed" for s in stats.steps)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.attention_backend.startswith("cpu (C++")


def test_without_a_compiler_the_torch_path_runs_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cpu_attention, "cpu_kernel_status", lambda: "no C++ compiler (test)")
    with caplog.at_level(logging.WARNING):
        llm = LLM(attention_backend="cpu", **COMMON)
    assert "runs the torch path: no C++ compiler (test)" in caplog.text
    backend = llm.engine.runner.attn_backend
    assert backend.fallback_reason == "no C++ compiler (test)"
    reference = LLM(attention_backend="torch", **COMMON).generate(PROMPTS, PARAMS)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert "cpu kernel unavailable: no C++ compiler (test)" in llm.stats().attention_backend


def test_one_kernel_call_per_layer_covers_decodes_and_prefills():
    llm = LLM(attention_backend="cpu", **COMMON)
    backend = llm.engine.runner.attn_backend
    import torch

    from engine.runner.attention.base import AttentionInputs

    inputs = AttentionInputs(
        slot_mapping=torch.arange(5), decode_seq_lens=[3, 9], decode_block_tables=[[0], [1, 2]],
        prefill_q_lens=[3], prefill_ctx_lens=[20], prefill_block_tables=[[3, 4, 5]],
    )  # fmt: skip
    meta = backend.build_metadata(inputs, llm.engine.runner.kv_caches)
    assert isinstance(meta, CpuAttentionMetadata)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5]
    assert meta.seq_lens.tolist() == [3, 9, 20]
    assert meta.block_tables.tolist() == [[0, 0, 0], [1, 2, 0], [3, 4, 5]]


def test_kernel_views_are_kept_for_the_current_pool_only():
    """Each layer's permuted cache views are made once and reused; a new pool drops the old
    pool's, which would otherwise keep its memory alive."""
    llm = LLM(attention_backend="cpu", **COMMON)
    backend, runner = llm.engine.runner.attn_backend, llm.engine.runner
    llm.generate(PROMPTS[:2], PARAMS)
    keys = {id(cache[0]) for cache in runner.kv_caches}
    assert set(backend._views) == keys  # one entry per layer of the pool in use
    views = backend._views[id(runner.kv_caches[0][0])][1]
    llm.generate(PROMPTS[:2], PARAMS)
    assert backend._views[id(runner.kv_caches[0][0])][1][0] is views[0]  # reused, not remade
    backend.allocate_kv_caches(runner.arch.num_layers, 4)
    assert backend._views == {}
