"""Prefix caching: full blocks of computed tokens are found again by content, shared with ref
counts, kept while free ("cached") and evicted oldest first; outputs never change."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager

BS = 4


def computed(bm: BlockManager, request_id: str, tokens: list[int], prefix=()) -> list[int]:
    """Allocate for `tokens` (sharing `prefix`) and mark them all computed, like a prefill."""
    bm.allocate(request_id, len(tokens), prefix)
    bm.cache_full_blocks(request_id, tokens, len(tokens))
    return bm.block_table(request_id)


def test_lookup_finds_full_blocks_by_content_and_leaves_the_last_token():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    tokens = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    table = computed(bm, "a", tokens)
    assert bm.lookup_prefix([*tokens, 99]) == table[:2]
    assert bm.lookup_prefix(list(range(8))) == table[:1]  # 8 tokens: the last must be computed
    assert bm.lookup_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9]) == table[:1]  # diverges in block 2
    assert bm.lookup_prefix([1, 0, 2, 3, 4, 5, 6, 7, 8]) == []  # same multiset, other order
    assert BlockManager(16, BS).lookup_prefix(tokens) == []  # caching off


def test_a_block_key_covers_everything_before_it():
    """Block 2 of two prompts holds the same tokens after different block 1s: no hit."""
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, "a", [1, 1, 1, 1, 5, 6, 7, 8, 0])
    assert bm.lookup_prefix([2, 2, 2, 2, 5, 6, 7, 8, 0]) == []


def test_shared_blocks_are_ref_counted_then_cached_then_evicted_oldest_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    tokens = list(range(12))
    table_a = computed(bm, "a", tokens)  # 3 full blocks
    prefix = bm.lookup_prefix(tokens)
    assert prefix == table_a[:2]  # the third holds the last token, which must be computed
    assert bm.blocks_needed("b", 12, prefix) == 1
    table_b = computed(bm, "b", tokens, prefix)
    snap = bm.snapshot()
    assert [snap.ref_counts[b] for b in table_a] == [2, 2, 1]
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert bm.num_free_blocks == 2
    bm.check_invariants()

    bm.free("a")
    bm.free("b")
    snap = bm.snapshot()
    assert [snap.states[b] for b in table_a] == ["cached"] * 3
    assert snap.states[table_b[2]] == "free"  # its key was cached in a's block first
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    assert bm.blocks_needed("c", 12, prefix) == 3  # two revived from the free list + one new
    # New tokens take never-used blocks first, then the oldest freed: tails before heads.
    bm.allocate("d", 2 * BS)
    assert bm.num_evictions_total == 0
    bm.allocate("e", 2 * BS)  # a's tail (cached: evicted) and b's tail (not cached)
    assert bm.num_evictions_total == 1
    assert bm.lookup_prefix(tokens) == table_a[:2]  # the heads survived
    bm.check_invariants()


def test_a_prefix_computed_twice_at_once_stays_private_the_second_time():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    tokens = list(range(9))
    table_a = computed(bm, "a", tokens)
    table_b = computed(bm, "b", tokens)  # no lookup: both computed the prefix
    assert bm.lookup_prefix(tokens) == table_a[:2]
    bm.free("a")
    assert bm.lookup_prefix(tokens) == table_a[:2]  # still cached while free
    bm.free("b")
    assert bm.num_cached_blocks == 2  # b's copies were never keyed
    assert not set(table_b) & set(bm.lookup_prefix(tokens))
    bm.check_invariants()


def test_contiguous_layout_refuses_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(8, BS, "contiguous", 16, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_layout="contiguous", enable_prefix_caching=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans()), max_size=40))
def test_invariants_hold_through_random_sharing(ops):
    """Random requests over three prompt families: allocate (sharing what is cached) or free;
    ref counts, the free list and the key map stay consistent, and a shared prefix's blocks
    always hold that prefix."""
    bm = BlockManager(12, BS, enable_prefix_caching=True)
    families = [[f * 100 + i for i in range(14)] for f in range(3)]
    live: dict[str, list[int]] = {}
    for slot, length, grow in ops:
        request_id = f"r{slot}"
        if request_id in live and not grow:
            bm.free(request_id)
            del live[request_id]
            continue
        if request_id in live:
            continue
        tokens = families[slot % 3][:length]
        prefix = bm.lookup_prefix(tokens)
        if not bm.can_allocate(request_id, len(tokens), prefix):
            continue
        computed(bm, request_id, tokens, prefix)
        live[request_id] = tokens
        bm.check_invariants()
    for request_id in list(live):
        bm.free(request_id)
    bm.check_invariants()
    assert bm.num_free_blocks == 12


# --- the engine ---------------------------------------------------------------------------

SYSTEM = (
    "You are a helpful assistant for a small bakery. Answer in one short sentence, be "
    "friendly, and mention the daily special when it fits. Question: "
)
QUESTIONS = ["When do you open?", "Do you sell rye bread?", "What is today's special?"]


@pytest.fixture(scope="module")
def cached_llm():
    return LLM(dtype="float32", max_model_len=512, enable_prefix_caching=True, block_size=8)


@pytest.mark.slow
def test_prefix_hits_skip_prefill_and_keep_tokens(cached_llm, llm_f32):
    """Same greedy tokens as an engine without the cache; the second round computes only
    what the first did not leave cached, and every block is back on the free list."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = [o.token_ids for o in llm_f32.generate(prompts, params)]
    before = cached_llm.stats()
    first = cached_llm.generate(prompts[:1], params)  # fills the cache with the system prompt
    mid = cached_llm.stats()
    rest = cached_llm.generate(prompts[1:], params)
    after = cached_llm.stats()
    assert [o.token_ids for o in first + rest] == expected

    hits = after.num_prefix_hit_tokens_total - mid.num_prefix_hit_tokens_total
    prompt_tokens = sum(len(o.prompt_token_ids) for o in rest)
    shared = len(cached_llm.tokenizer(SYSTEM)["input_ids"])
    assert hits >= 2 * (shared // 8 - 1) * 8  # whole blocks of the system prompt, each time
    assert all(o.metrics.num_cached_tokens > 0 for o in rest)
    computed_prefill = sum(s.num_prefill_tokens for s in after.steps[len(mid.steps) :])
    # Every prompt token is either found cached or computed (decode steps compute 1 each).
    assert computed_prefill == prompt_tokens - hits
    assert after.num_prefix_query_tokens_total - mid.num_prefix_query_tokens_total == prompt_tokens
    assert before.num_free_kv_blocks == after.num_free_kv_blocks == after.num_kv_blocks
    assert after.num_cached_kv_blocks > 0
    cached_llm.engine.block_manager.check_invariants()


def test_running_requests_share_blocks_in_the_block_map(cached_llm):
    engine = cached_llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request(SYSTEM + "first", params, request_id="share-a")
    first = engine.scheduler.waiting[-1]
    while first.num_computed_tokens < first.num_prompt_tokens:  # until its prompt is cached
        engine.step()
    engine.add_request(SYSTEM + "second", params, request_id="share-b")
    engine.step()
    snap = engine.block_snapshot()
    table_a = engine.block_manager.block_table("share-a")
    table_b = engine.block_manager.block_table("share-b")
    shared = set(table_a) & set(table_b)
    assert shared and all(snap.ref_counts[b] == 2 for b in shared)
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_invariants()
    assert engine.stats().num_free_kv_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_preemption_with_prefix_caching_keeps_tokens(llm_f32):
    """A pool too small for the batch: requests are preempted and readmitted through the
    prefix cache (often hitting their own earlier blocks); the tokens do not change."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS * 2]
    expected = [o.token_ids for o in llm_f32.generate(prompts, params)]
    llm = LLM(
        dtype="float32", max_model_len=512, enable_prefix_caching=True, block_size=8,
        num_kv_blocks=24,
    )  # fmt: skip
    out = llm.generate(prompts, params)
    stats = llm.stats()
    assert [o.token_ids for o in out] == expected
    assert stats.num_preemptions_total > 0 and stats.num_prefix_hit_tokens_total > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    llm.engine.block_manager.check_invariants()


@pytest.mark.slow
def test_static_batching_uses_the_prefix_cache_too(llm_f32):
    """Static batches admit from the cache as well: the second batch finds the first's
    system-prompt blocks; tokens unchanged, nothing leaked."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = [o.token_ids for o in llm_f32.generate(prompts, params)]
    llm = LLM(
        dtype="float32", max_model_len=512, enable_prefix_caching=True, block_size=8,
        batching="static", max_num_seqs=1,
    )  # fmt: skip
    out = llm.generate(prompts, params)
    stats = llm.stats()
    assert [o.token_ids for o in out] == expected
    assert stats.num_prefix_query_tokens_total == sum(len(o.prompt_token_ids) for o in out)
    assert stats.num_prefix_hit_tokens_total > 0 and out[0].metrics.num_cached_tokens == 0
    assert all(o.metrics.num_cached_tokens > 0 for o in out[1:])
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    llm.engine.block_manager.check_invariants()
