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
    assert llm.engine.runner.kv_caches[0].key.dtype.itemsize == (4 if dtype == "float32" else 2)


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


def test_generation_stops_at_max_model_len():
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=16, max_model_len=64)
    out = llm.generate([[9] * 60], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_params_list_must_match_prompts(tiny_llm):
    with pytest.raises(ValueError, match=r"^params: 1 given for 2 prompts"):
        tiny_llm.generate([[1, 2], [3, 4]], [SamplingParams()])


def test_text_needs_a_tokenizer(tmp_path):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        tmp_path
    )
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"^prompt: model .* has no tokenizer; pass ids"):
        llm.generate(["some text"])
    with pytest.raises(ValueError, match=r"^messages: model .* has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finished
