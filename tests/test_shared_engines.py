"""The session's shared engines (tests/conftest.py): one LLM per EngineConfig, however the
arguments are spelt, and a new engine for any other config."""

from __future__ import annotations

TINY = dict(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=64)


def test_make_llm_shares_one_engine_per_config(make_llm, tiny_llm):
    assert make_llm(**TINY) is tiny_llm
    assert make_llm(**TINY, seed=0, block_size=16) is tiny_llm  # the defaults, spelt out
    other = make_llm(**{**TINY, "num_kv_blocks": 32})
    assert other is not tiny_llm and other.config.num_kv_blocks == 32
