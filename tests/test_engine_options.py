"""Engine options end to end: dtypes, stop tokens, repetition penalty, filtered sampling."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPT = [101, 2021, 7, 99, 4000, 31]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_runs(dtype):
    llm = LLM(model="random:tiny", dtype=dtype, num_kv_blocks=16, max_model_len=128)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    assert llm.engine.runner.kv_cache.dtype.itemsize == (4 if dtype == "float32" else 2)


def test_stop_token_ids_end_the_request_and_are_kept(tiny_llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = tiny_llm.generate([PROMPT], greedy)[0].token_ids
    stop = tokens[4]
    first = tokens.index(stop)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    out = tiny_llm.generate([PROMPT], params)[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"


def test_repetition_penalty_changes_a_repetitive_continuation(llm_f32):
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"
    plain = llm_f32.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    penalized = llm_f32.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=2.0)
    )[0]
    assert plain.token_ids != penalized.token_ids


def test_filtered_sampling_is_reproducible_with_a_seed(llm_f32):
    params = SamplingParams(max_tokens=10, temperature=1.5, top_k=3, top_p=0.9, min_p=0.05,
                            seed=7)  # fmt: skip
    alone = llm_f32.generate(["Once upon a time"], params)[0]
    with_company = llm_f32.generate(["Once upon a time", "unrelated"], [params, params])[0]
    assert alone.token_ids == with_company.token_ids and len(alone.token_ids) == 10
