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


def test_logit_bias_forces_and_bans_tokens(llm_f32):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = llm_f32.generate(["The capital of France is"], greedy)[0].token_ids
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={42: 100})
    assert llm_f32.generate(["The capital of France is"], forced)[0].token_ids == [42] * 6
    banned = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            logit_bias={str(plain[0]): -100})  # fmt: skip
    assert llm_f32.generate(["The capital of France is"], banned)[0].token_ids[0] != plain[0]
    with pytest.raises(ValueError, match=r"logit_bias: token id 10000000 is outside"):
        llm_f32.generate(["x"], SamplingParams(logit_bias={10_000_000: 1.0}))


def test_frequency_penalty_breaks_a_repetition(llm_f32):
    """The greedy continuation of a counting loop repeats its tokens; a frequency penalty (on
    the output only) pushes the reply to other tokens, a negative one does not."""
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"

    def distinct(**penalty) -> int:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalty)
        return len(set(llm_f32.generate([prompt], params)[0].token_ids))

    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain
    assert distinct(frequency_penalty=-2.0) <= plain  # negative values encourage repeats


def test_penalties_give_the_same_tokens_with_speculative_decoding(monkeypatch):
    """Verification applies each drafted position's penalties with the drafts before it counted
    as output, so greedy tokens equal one-token decoding's. The drafts are the true
    continuation (a proposer that knows it), so each is accepted only if its row's penalties
    are the ones one-token decoding applied."""
    from engine.core import spec_decode

    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            frequency_penalty=0.3, presence_penalty=0.2,
                            logit_bias={9: 0.5})  # fmt: skip
    kwargs = dict(model="random:tiny", dtype="float32", num_kv_blocks=32, max_model_len=128)
    want = LLM(**kwargs).generate([prompt], params)[0].token_ids
    assert len(set(want)) > 2  # the penalties are at work: no single repeated token

    def propose(token_ids, k, min_n, max_n):
        done = len(token_ids) - len(prompt)
        return list(want[done : done + k])

    monkeypatch.setattr(spec_decode, "propose_ngram", propose)
    spec = LLM(**kwargs, speculative_method="ngram", num_speculative_tokens=3)
    assert spec.generate([prompt], params)[0].token_ids == want
    stats = spec.stats()
    assert stats.num_accepted_tokens_total >= 12  # most drafts checked and kept
