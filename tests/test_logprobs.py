"""Log-probabilities (SamplingParams.logprobs / prompt_logprobs) equal log_softmax of a plain
float32 transformers forward of the same weights, for generated and prompt tokens, through
chunked prefill, preemption, prefix caching and speculative decoding; they are the raw
model's (before penalty and temperature)."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import reference_logprobs

from engine import LLM, SamplingParams
from engine.request import MAX_LOGPROBS, TokenLogprob

TOL = 2e-4  # float32: our paged attention vs transformers' eager attention
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods",
    "Hi",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21",
]
NUM_TOP = 3


@pytest.fixture(scope="module")
def llm(tiny_hf_folder) -> LLM:
    return LLM(str(tiny_hf_folder), dtype="float32", max_model_len=256, num_kv_blocks=64)


def _check(folder, prompt_ids: list[int], out_ids: list[int], scored, first: int, k: int):
    """`scored[i]` is the TokenLogprob of token first + i of prompt + output."""
    ids = prompt_ids + out_ids
    ref = reference_logprobs(folder, ids)  # [T, V]
    for i, lp in enumerate(scored):
        pos = first + i
        assert isinstance(lp, TokenLogprob) and lp.token_id == ids[pos]
        row = ref[pos - 1]
        assert lp.logprob == pytest.approx(float(row[ids[pos]]), abs=TOL), f"token {pos}"
        assert lp.rank == int((row > row[ids[pos]]).sum()) + 1 or abs(
            float(row.sort(descending=True).values[lp.rank - 1]) - lp.logprob) < TOL  # fmt: skip
        top_vals, top_ids = row.topk(k)
        assert [t for t, _ in lp.top] == top_ids.tolist(), f"top-{k} ids of token {pos}"
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=TOL)


def _check_output(folder, out, k: int = NUM_TOP, prompt_k: int | None = NUM_TOP) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    _check(folder, out.prompt_token_ids, out.token_ids, out.logprobs, len(out.prompt_token_ids), k)
    if prompt_k is not None:
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        _check(folder, out.prompt_token_ids, [], out.prompt_logprobs[1:], 1, prompt_k)


def test_greedy_batch_matches_plain_torch(llm, tiny_hf_folder):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=NUM_TOP, prompt_logprobs=2)
    for out in llm.generate(PROMPTS, params):
        _check_output(tiny_hf_folder, out, prompt_k=2)
        assert all(lp.rank == 1 for lp in out.logprobs)  # greedy takes the argmax


def test_off_by_default_and_zero_means_no_alternatives(llm):
    off = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert off.logprobs is None and off.prompt_logprobs is None
    zero = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))
    assert all(lp.top == () for lp in zero[0].logprobs)


def test_raw_logprobs_before_penalty_and_temperature(llm, tiny_hf_folder):
    """Sampled with temperature, top-k and a repetition penalty, the logprobs stay those of
    the raw model at the tokens drawn (documented choice: docs/logprobs.md)."""
    params = SamplingParams(max_tokens=8, temperature=0.5, top_k=20, repetition_penalty=1.5,
                            seed=7, logprobs=NUM_TOP)  # fmt: skip
    out = llm.generate(PROMPTS[0], params)[0]
    _check_output(tiny_hf_folder, out, prompt_k=None)


def test_chunked_prefill_scores_every_prompt_token_once(tiny_hf_folder):
    llm = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=7)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, prompt_logprobs=NUM_TOP)
    for out in llm.generate(PROMPTS, params):
        _check_output(tiny_hf_folder, out, k=1)


def test_preempted_requests_keep_exact_logprobs(tiny_hf_folder):
    """A pool too small for all at once: requests are preempted and recomputed; their prompt
    logprobs are not scored twice and every value still matches."""
    llm = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=128, num_kv_blocks=24,
              block_size=4)  # fmt: skip
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP,
                            prompt_logprobs=NUM_TOP)  # fmt: skip
    # Admitted together (prompts of 19, 1 and ~17 tokens), they outgrow 24 blocks decoding.
    prompts = [*PROMPTS[:2], "Once upon a time there was a small cat that lived in a big house"]
    outs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test must preempt"
    for out in outs:
        _check_output(tiny_hf_folder, out)


def test_prompt_logprobs_skip_the_prefix_cache(tiny_hf_folder):
    """Cached prompt tokens are never run, so they have no logits: a prompt_logprobs request
    computes its whole prompt (no hit), a plain one with the same prompt hits the cache."""
    llm = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=256, num_kv_blocks=64,
              block_size=4, enable_prefix_caching=True)  # fmt: skip
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate(PROMPTS[0], greedy)  # fills the cache
    plain = llm.generate(PROMPTS[0], greedy)[0]
    assert plain.metrics.num_cached_tokens > 0
    scored = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, logprobs=2, prompt_logprobs=2)
    )[0]
    assert scored.metrics.num_cached_tokens == 0
    _check_output(tiny_hf_folder, scored, k=2, prompt_k=2)


def _oracle_drafts(llm: LLM, continuation: list[int], k: int) -> None:
    """Make the proposer draft the known greedy continuation (a random model never repeats
    its context, so n-gram drafts would all be rejected): every draft is then accepted and
    each step scores several verified tokens, the path under test."""

    def propose(running):
        drafts = {}
        for r in running:
            if r.num_computed_tokens + 1 == r.num_tokens:
                n = r.num_output_tokens
                room = r.params.max_tokens - n - 1
                drafts[r.request_id] = continuation[n : n + min(k, room)]
        return {rid: d for rid, d in drafts.items() if d}

    llm.engine.proposer.propose = propose


def test_speculative_decoding_scores_each_accepted_token(llm, tiny_hf_folder):
    spec = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=256, num_kv_blocks=64,
               speculative_method="ngram", num_speculative_tokens=3)  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
    expected = llm.generate(PROMPTS[0], params)[0]
    _oracle_drafts(spec, expected.token_ids, 3)
    out = spec.generate(PROMPTS[0], params)[0]
    assert spec.stats().num_accepted_tokens_total >= 6, "drafts must be accepted"
    assert out.token_ids == expected.token_ids
    _check_output(tiny_hf_folder, out, prompt_k=None)

    # A stop token inside the accepted drafts: later tokens and their logprobs are dropped.
    stop_at = expected.token_ids[5]
    cut = spec.generate(PROMPTS[0], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, stop_token_ids=[stop_at],
    ))[0]  # fmt: skip
    assert cut.token_ids == expected.token_ids[: expected.token_ids.index(stop_at) + 1]
    assert [lp.token_id for lp in cut.logprobs] == cut.token_ids


def test_stop_string_inside_drafts_keeps_logprobs_aligned(llm, tiny_hf_folder):
    spec = LLM(str(tiny_hf_folder), dtype="float32", max_model_len=256, num_kv_blocks=64,
               speculative_method="ngram", num_speculative_tokens=4)  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    expected = llm.generate(PROMPTS[0], params)[0]
    _oracle_drafts(spec, expected.token_ids, 4)
    stop = expected.text[len(expected.text) // 2 :][:2]
    assert stop.strip(), "the greedy text needs printable characters"
    out = spec.generate(PROMPTS[0], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, stop=stop))[0]  # fmt: skip
    assert out.finish_reason == "stop" and len(out.token_ids) < len(expected.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    kept = expected.logprobs[: len(out.token_ids)]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in kept],
                                                                abs=TOL)  # fmt: skip


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_bad_values_name_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name}:"):
        SamplingParams(**{name: value})


def test_batched_scoring_keeps_each_requests_k_and_fails_only_the_culprit(
    llm, tiny_hf_folder, monkeypatch
):
    """A step's requests with logprobs are scored in one batched call (one log_softmax and one
    top-k); each still gets its own number of alternatives. If that call raises, each request
    is scored alone, and only the one whose scoring raises fails."""
    params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=k) for k in (1, 3, 0)]
    outs = llm.generate(PROMPTS, params)
    for out, k in zip(outs, (1, 3, 0), strict=True):
        _check_output(tiny_hf_folder, out, k=k, prompt_k=None)
        assert all(len(lp.top) == k for lp in out.logprobs)

    import engine.runner.logprobs as logprobs_module

    real = logprobs_module.token_logprobs

    def poisoned(logits, token_ids, num_top):
        if num_top == 4:  # the batch (k = max = 4) and the poisoned request alone
            raise RuntimeError("injected scoring failure")
        return real(logits, token_ids, num_top)

    monkeypatch.setattr(logprobs_module, "token_logprobs", poisoned)
    params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=k) for k in (1, 4, 2)]
    good_a, bad, good_b = llm.generate(PROMPTS, params)
    assert bad.error and "injected scoring failure" in bad.error
    for out, k in ((good_a, 1), (good_b, 2)):
        assert out.error is None and len(out.token_ids) == 4
        _check_output(tiny_hf_folder, out, k=k, prompt_k=None)
