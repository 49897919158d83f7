"""Parallel sampling (SamplingParams.n > 1): the n sequences share the prompt's KV blocks by
ref count (the partly filled last block included), the first write into the shared partial
block copies it exactly once per extra holder (copy-on-write, counted in telemetry), every
sequence equals a single-sequence run with its seed (seed + i) in float32, a group is
preempted as a unit and recomputed exactly, and aborting a group leaks no block."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.engine import LLMEngine
from engine.request import RequestStatus

BLOCK_SIZE = 4
# 10 tokens: 9 before the fork point, so the shared last block holds 1 of its 4 tokens and
# the first write (position 9) lands in it.
PROMPT = "The quick brown fox jumps over the lazy dog again"


def _llm(folder, **kwargs) -> LLM:
    config = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=BLOCK_SIZE)
    return LLM(str(folder), **(config | kwargs))


@pytest.fixture(scope="module")
def llm(tiny_hf_folder) -> LLM:
    return _llm(tiny_hf_folder)


def _prompt_ids(llm: LLM) -> list[int]:
    ids = list(llm.tokenizer(PROMPT).input_ids)
    assert (len(ids) - 1) % BLOCK_SIZE != 0, "the fork point must fall inside a block"
    return ids


def _step_until(engine: LLMEngine, done, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError("condition not reached")


def test_samples_share_prompt_blocks_and_copy_the_partial_one_once(llm):
    engine = llm.engine
    ids = _prompt_ids(llm)
    copies_before = engine.block_manager.num_block_copies_total
    rid = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2))
    _step_until(engine, lambda: len(engine.scheduler.running) == 2)  # forked
    leader, sample = engine.scheduler.running
    table = engine.block_manager.block_table(leader.request_id)
    assert engine.block_manager.block_table(sample.request_id) == table
    snap = engine.block_snapshot()
    assert len(table) == -(-(len(ids) - 1) // BLOCK_SIZE)  # prompt but its last token
    assert [snap.ref_counts[b] for b in table] == [2] * len(table)  # partial block included

    engine.step()  # both write position len(ids) - 1, into the shared partial block
    assert engine.block_manager.num_block_copies_total - copies_before == 1
    assert engine.stats().steps[-1].num_block_copies == 1
    a = engine.block_manager.block_table(leader.request_id)
    b = engine.block_manager.block_table(sample.request_id)
    assert a[:-1] == b[:-1] == table[:-1] and a[-1] != b[-1]  # full blocks still shared
    assert table[-1] in (a[-1], b[-1])  # the last writer kept the original in place
    snap = engine.block_snapshot()
    assert [snap.ref_counts[x] for x in a[:-1]] == [2] * (len(a) - 1)
    assert snap.ref_counts[a[-1]] == snap.ref_counts[b[-1]] == 1
    _step_until(engine, lambda: not engine.has_unfinished())
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    engine.block_manager.check_invariants()
    assert rid not in engine._groups


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_sample_equals_a_single_run_with_its_seed(llm, temperature):
    """Both sequences keep correct K/V through the copy: each equals a lone run seeded
    seed + i, tokens and logprobs (greedy: all n are the same sequence)."""
    params = dict(max_tokens=8, temperature=temperature, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPT, SamplingParams(seed=11, n=3, prompt_logprobs=1, **params))
    assert [o.index for o in outs] == [0, 1, 2]
    for i, out in enumerate(outs):
        alone = llm.generate(PROMPT, SamplingParams(seed=11 + i, prompt_logprobs=1, **params))[0]
        assert out.token_ids == alone.token_ids, f"sample {i}"
        # float32: 3 rows and 1 row take different matmul blocking, so the logprobs agree to
        # float32 rounding carried through the layers (measured up to 3.5e-6 relative).
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(
            [lp.logprob for lp in alone.logprobs], rel=1e-5, abs=1e-5
        )
        assert [p and p.token_id for p in out.prompt_logprobs] == [
            p and p.token_id for p in alone.prompt_logprobs
        ]
    if temperature > 0:
        assert len({tuple(o.token_ids) for o in outs}) > 1, "seeds seed, seed+1, ... differ"
    else:
        assert len({tuple(o.token_ids) for o in outs}) == 1


def test_group_is_preempted_as_a_unit_and_recomputed_exactly(tiny_hf_folder, llm):
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=3, n=2, ignore_eos=True)
    other = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = llm.generate([PROMPT, "Hello there"], [params, other])
    small = _llm(tiny_hf_folder, num_kv_blocks=20)  # 3 sequences of ~34 tokens need 27
    outs = small.generate([PROMPT, "Hello there"], [params, other])
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    group = [o for o in outs if o.request_id == outs[0].request_id]
    assert group[0].metrics.num_preemptions > 0, "the test must preempt the group"
    assert group[0].metrics.num_preemptions == group[1].metrics.num_preemptions  # together
    stats = small.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    small.engine.block_manager.check_invariants()


@pytest.mark.parametrize("when", ["before_fork", "after_fork"])
def test_abort_of_a_group_leaks_nothing(llm, when):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=50, temperature=1.0, n=4))
    if when == "after_fork":
        _step_until(engine, lambda: len(engine.scheduler.running) == 4)
        engine.step()  # copies made
    out = engine.abort(rid)
    assert out is not None and out.finish_reason == "abort" and out.request_finished
    assert not engine.has_unfinished() and rid not in engine._groups
    assert not any(r.startswith(rid) for r in engine._requests)
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    engine.block_manager.check_invariants()
    assert engine.abort(rid) is None


def test_a_failed_sample_does_not_end_its_siblings(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, n=2))
    _step_until(engine, lambda: len(engine.scheduler.running) == 2)
    outs = engine._fail(f"{rid}#1", "engine error: test")
    assert len(outs) == 1 and outs[0].index == 1 and not outs[0].request_finished
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.index, o.finish_reason, o.request_finished) for o in finals] == [(0, "length", True)]
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_samples_with_prefix_caching_and_speculative_decoding(tiny_hf_folder, llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=3, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPT, params)]
    for kwargs in ({"enable_prefix_caching": True}, {"speculative_method": "ngram"}):
        other = _llm(tiny_hf_folder, **kwargs)
        for _ in range(2):  # the second run hits the prefix cache (or drafts from the first)
            assert [o.token_ids for o in other.generate(PROMPT, params)] == expected, kwargs
        other.engine.block_manager.check_invariants()
        assert other.stats().num_free_kv_blocks == other.stats().num_kv_blocks


def test_single_token_prompt_forks_at_admission(llm):
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, n=2)
    outs = llm.generate([[504]], params)
    alone = [llm.generate([[504]], SamplingParams(max_tokens=4, temperature=1.0, seed=2 + i))[0]
             for i in range(2)]  # fmt: skip
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]


def test_bad_n_names_the_field(llm):
    with pytest.raises(ValueError, match=r"^n:"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"^n:.*max_num_seqs"):
        llm.engine.make_request(PROMPT, SamplingParams(n=65))
    with pytest.raises(ValueError, match=r"^n:.*KV blocks"):
        llm.engine.make_request(PROMPT, SamplingParams(n=8, max_tokens=100))


def test_statuses_of_unforked_samples_after_abort(llm):
    engine = llm.engine
    request = engine.make_request(PROMPT, SamplingParams(max_tokens=4, n=3))
    engine.add(request)
    samples = list(request.pending_samples)
    engine.abort(request.group_id)
    assert all(s.status is RequestStatus.FINISHED_ABORTED for s in samples)


def _junk_drafts(llm: LLM, draft: list[int]) -> None:
    """Every decoding sequence verifies `draft`: its K/V are written past the last token,
    across block boundaries, whether accepted or not."""

    def propose(running):
        return {r.request_id: list(draft) for r in running
                if r.num_computed_tokens + 1 == r.num_tokens and r.output_token_ids}  # fmt: skip

    llm.engine.proposer.propose = propose


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_draft_writes_never_touch_a_siblings_blocks(tiny_hf_folder, layout):
    """Drafts write K/V up to 3 positions ahead, across block boundaries; in the contiguous
    layout the samples share their whole reservation. Each sample still equals a lone run
    verifying the same drafts."""
    kwargs = dict(kv_layout=layout, num_kv_blocks=128, speculative_method="ngram",
                  num_speculative_tokens=3)  # fmt: skip
    group, alone = _llm(tiny_hf_folder, **kwargs), _llm(tiny_hf_folder, **kwargs)
    _junk_drafts(group, [7, 8, 9])
    _junk_drafts(alone, [7, 8, 9])
    params = dict(max_tokens=12, temperature=0.9, ignore_eos=True)
    outs = group.generate(PROMPT, SamplingParams(seed=9, n=2, **params))
    for i, out in enumerate(outs):
        single = alone.generate(PROMPT, SamplingParams(seed=9 + i, **params))[0]
        assert out.token_ids == single.token_ids, f"sample {i}"
    assert group.stats().num_block_copies_total >= (1 if layout == "paged" else 2)
    group.engine.block_manager.check_invariants()
    assert group.stats().num_free_kv_blocks == group.stats().num_kv_blocks


def test_static_batching_runs_a_group(tiny_hf_folder, llm):
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=4, n=2, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPT, params)]
    static = _llm(tiny_hf_folder, batching="static")
    assert [o.token_ids for o in static.generate(PROMPT, params)] == expected


def test_copy_on_write_covers_every_shared_block_written():
    """A write range over several shared blocks (contiguous reservation, drafts across a
    boundary) copies each of them, not only the first; blocks past the table are new."""
    from engine.core.block_manager import BlockManager

    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", 12)  # 3 blocks
    bm.fork("a", "b")
    assert bm.num_shared_blocks("b", 2, 10) == 3 and bm.num_shared_blocks("b", 12, 16) == 0
    copies = bm.copy_on_write("b", 2, 10)
    assert [s for s, _ in copies] == bm.block_table("a") and len(copies) == 3
    assert set(bm.block_table("b")).isdisjoint(bm.block_table("a"))
    assert bm.copy_on_write("a", 0, 12) == []  # the last holder writes in place
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16
