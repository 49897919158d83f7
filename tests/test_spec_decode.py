"""Speculative decoding (n-gram drafts): proposals, the verifier's exactness, and the engine
giving one-token decoding's greedy tokens in fewer steps."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.core.spec_decode import propose_ngram, verify
from engine.runner.sampler import TokenHistory

# --- propose ----------------------------------------------------------------------------------


def test_propose_takes_what_followed_the_latest_earlier_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 2, 4) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert propose_ngram(tokens, 10, 2, 4) == [7, 8, 5, 1, 2, 3]  # up to the end
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing recurs
    assert propose_ngram([4, 1, 9, 9, 1], 2, 1, 3) == [9, 9]  # falls back to a 1-token match
    assert propose_ngram([4, 1, 9, 9, 1], 2, 2, 3) == []  # ... unless 2 tokens are required
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []
    assert propose_ngram([3], 2, 1, 3) == []


# --- verify -----------------------------------------------------------------------------------


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def one_hot_logits(targets: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_verify_keeps_matching_drafts_then_the_models_token():
    logits = one_hot_logits([4, 5, 6, 7])  # the model's argmax after each position
    assert verify(logits, [4, 5, 6], greedy(), None) == [4, 5, 6, 7]  # all kept + bonus
    assert verify(logits, [4, 9, 6], greedy(), None) == [4, 5]  # second draft wrong
    assert verify(logits, [1, 5, 6], greedy(), None) == [4]  # first draft wrong
    with pytest.raises(AssertionError, match="one row of logits per draft"):
        verify(logits, [4, 5], greedy(), None)


def test_greedy_verify_with_repetition_penalty_counts_earlier_drafts():
    """Row 1 must penalize draft 0 as one-token decoding would have (it was a prior token)."""
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    params = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=2.0)
    # Row 0: token 1 wins (nothing seen); row 1 has seen token 1: 3.0 / 2 < 2.9, token 2 wins.
    assert verify(logits, [1], params, None, history=TokenHistory([0], 1)) == [1, 2]


def test_greedy_verify_with_frequency_penalty_counts_earlier_drafts_as_output():
    """The same for the additive penalties, which count the output only: draft 0 is output."""
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    params = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=0.2)
    # Token 1 already in the output: 3.0 - 0.2 < 2.9 at row 0, the draft is rejected.
    assert verify(logits, [1], params, None, history=TokenHistory([0, 1], 1)) == [2]
    # Token 1 in the prompt only: row 0 keeps it; row 1 counts draft 0 as output.
    assert verify(logits, [1], params, None, history=TokenHistory([1], 1)) == [1, 2]
    bias = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={2: 0.2})
    assert verify(logits, [2], bias, None) == [2, 2]


@pytest.mark.slow
def test_rejection_sampling_preserves_the_target_distribution():
    """With any draft, the first token produced is distributed as p (q one-hot)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(2, 1)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    for draft in (0, 1, 3):
        counts = torch.zeros(4)
        n = 6000
        for _ in range(n):
            counts[verify(logits, [draft], params, gen)[0]] += 1
        assert torch.allclose(counts / n, p, atol=0.025), (draft, counts / n)


# --- the engine -------------------------------------------------------------------------------

COPYING = [
    "Repeat the list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
    "Again: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one two three four one two three four one two three four one two",
]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(dtype="float32", max_model_len=512, speculative_method="ngram")


@pytest.mark.slow
def test_greedy_tokens_equal_one_token_decoding_in_fewer_steps(spec_llm, llm_f32):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = [o.token_ids for o in llm_f32.generate(COPYING, params)]
    before = spec_llm.stats()
    out = spec_llm.generate(COPYING, params)
    after = spec_llm.stats()
    assert [o.token_ids for o in out] == expected
    drafts = after.num_draft_tokens_total - before.num_draft_tokens_total
    accepted = after.num_accepted_tokens_total - before.num_accepted_tokens_total
    assert drafts > 0 and accepted > 0
    steps = after.steps[len(before.steps) :]
    assert sum(s.num_draft_tokens for s in steps) == drafts
    assert sum(s.num_accepted_tokens for s in steps) == accepted
    # Every output token came from a step: decode steps produced more than one token each.
    assert len(steps) < max(len(t) for t in expected) + 2
    assert after.num_free_kv_blocks == after.num_kv_blocks
    spec_llm.engine.block_manager.check_invariants()


def test_drafts_never_overrun_max_tokens_or_stops(spec_llm, llm_f32):
    """Exact lengths, stop strings and stop tokens cut the accepted drafts where one-token
    decoding would have stopped."""
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop=["four one"]),
    ):
        expected = llm_f32.generate(COPYING, params)
        out = spec_llm.generate(COPYING, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in expected]
        assert [o.text for o in out] == [o.text for o in expected]
        assert [o.finish_reason for o in out] == [o.finish_reason for o in expected]
    stop_token = llm_f32.generate(COPYING[2:], SamplingParams(max_tokens=6, temperature=0.0))
    stop_id = stop_token[0].token_ids[3]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id])
    assert [o.token_ids for o in spec_llm.generate(COPYING[2:], params)] == [
        o.token_ids for o in llm_f32.generate(COPYING[2:], params)
    ]


def test_seeded_sampling_with_drafts_is_reproducible_and_well_formed(spec_llm):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    first = spec_llm.generate(COPYING, params)
    again = spec_llm.generate(COPYING, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 24 for o in first)
    assert all(o.metrics.num_output_tokens == 24 for o in first)


def test_spec_decode_with_prefix_caching_and_preemption_keeps_tokens(llm_f32):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = COPYING * 2
    expected = [o.token_ids for o in llm_f32.generate(prompts, params)]
    llm = LLM(
        dtype="float32", max_model_len=512, speculative_method="ngram", block_size=8,
        enable_prefix_caching=True, num_kv_blocks=30,
    )  # fmt: skip
    out = llm.generate(prompts, params)
    stats = llm.stats()
    assert [o.token_ids for o in out] == expected
    assert stats.num_preemptions_total > 0 and stats.num_accepted_tokens_total > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    llm.engine.block_manager.check_invariants()


def test_config_checks_speculative_fields():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=3)


def test_scheduler_verifies_drafts_and_rewinds_the_rejected_ones():
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.request import Request

    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    request = Request("a", list(range(6)), params, arrival_time=0.0, max_total_tokens=128)
    sched.add_request(request)
    out = sched.schedule()
    sched.update(out, {"a": [7]})
    assert (request.num_computed_tokens, request.num_tokens) == (6, 7)

    out = sched.schedule(drafts={"a": [8, 9, 10]})
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.num_draft_tokens, item.samples) == (4, 3, True)
    assert item.draft_token_ids == [8, 9, 10]
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 0
    assert len(sched.block_manager.block_table("a")) == 3  # room for all 10 positions
    sched.update(out, {"a": [8, 9, 11]})  # two drafts accepted, the third replaced by 11
    assert request.output_token_ids == [7, 8, 9, 11]
    assert request.num_computed_tokens == 9 == request.num_tokens - 1
    assert request.num_new_output_tokens == 3
    assert len(request.metrics.token_times) == 4
    (item,) = sched.schedule().scheduled  # drafts live in one step's output, not the request
    assert (item.num_new_tokens, item.draft_token_ids) == (1, [])


def test_scheduler_cuts_drafts_to_the_budget_and_ignores_them_while_prefilling():
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.request import Request

    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    request = Request("a", [1, 2, 3], params, arrival_time=0.0, max_total_tokens=64)
    sched.add_request(request)
    (item,) = sched.schedule(drafts={"a": [4, 5]}).scheduled  # the prompt: no drafts yet
    assert (item.num_new_tokens, item.draft_token_ids) == (3, [])
    request.num_computed_tokens = 3
    request.output_token_ids.append(9)
    (item,) = sched.schedule(drafts={"a": [4, 5, 6, 7]}).scheduled
    assert (item.num_new_tokens, item.draft_token_ids) == (3, [4, 5])  # 1 + 2 drafts = budget


def test_proposer_drafts_only_for_decoding_requests_within_their_limits():
    from engine.core.spec_decode import NgramProposer
    from engine.request import Request

    proposer = NgramProposer(EngineConfig(speculative_method="ngram", num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]  # "1 2" recurs: the draft is what followed, 3 4 5 6
    prompt = tokens[:-1]  # and one output token, 2: decoding

    def make(rid: str, max_tokens: int, num_output: int = 1) -> Request:
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), 0.0, max_total_tokens=64)
        r.output_token_ids = tokens[len(prompt) :][:num_output]
        r.num_computed_tokens = len(prompt) + num_output - 1
        return r

    decoding = make("d", 10)
    short = make("s", 4)  # 1 output token, room for 3 more: 2 drafts + 1
    prefilling = Request("p", tokens, SamplingParams(max_tokens=10), 0.0, max_total_tokens=64)
    # The last prompt token computed alone (a final 1-token chunk, or a parallel-sampling
    # sequence after its fork): its first token comes without drafts.
    last_prompt_token = Request("l", tokens, SamplingParams(max_tokens=10), 0.0,
                                max_total_tokens=64)  # fmt: skip
    last_prompt_token.num_computed_tokens = len(tokens) - 1
    proposed = proposer.propose([decoding, short, prefilling, last_prompt_token])
    assert proposed == {"d": [3, 4, 5, 6], "s": [3, 4]}
