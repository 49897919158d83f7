"""BlockManager: allocation, freeing, layouts, the block map, and no leaks under any sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager


def test_paged_allocates_on_demand():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) and len(bm.block_table("a")) == 2  # ceil(5/4)
    assert bm.allocate("a", 8) == []  # still fits in 2 blocks
    assert len(bm.allocate("a", 9)) == 1
    assert bm.num_free_blocks == 5
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_contiguous_reserves_max_model_len():
    bm = BlockManager(num_blocks=10, block_size=4, layout="contiguous", max_model_len=16)
    bm.allocate("a", 1)
    assert len(bm.block_table("a")) == 4  # 16 tokens reserved up front
    snap = bm.snapshot()
    assert snap.states.count("used") == 1 and snap.states.count("reserved") == 3
    assert bm.blocks_needed("b", 1) == 4
    bm.allocate("b", 1)
    assert not bm.can_allocate("c", 1)  # 2 blocks left, 4 needed
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("a", 9)
    assert bm.num_free_blocks == 2 and not bm.has_blocks("a")


def test_snapshot_owners_and_fill():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 6)
    snap = bm.snapshot()
    table = bm.block_table("a")
    assert [snap.owners[b] for b in table] == ["a", "a"]
    assert [snap.tokens_filled[b] for b in table] == [4, 2]
    assert [snap.ref_counts[b] for b in table] == [1, 1]
    assert snap.num_free == 2


def test_free_unknown_is_a_no_op():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.free("nobody") == 0
    bm.check_invariants()


ops = st.lists(
    st.tuples(
        st.sampled_from(["grow", "free"]),
        st.integers(min_value=0, max_value=5),  # request index
        st.integers(min_value=1, max_value=40),  # tokens to add
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, layout=st.sampled_from(["paged", "contiguous"]))
def test_random_sequences_never_leak_or_double_free(ops, layout):
    bm = BlockManager(num_blocks=24, block_size=4, layout=layout, max_model_len=32)
    tokens: dict[str, int] = {}
    for op, idx, n in ops:
        rid = f"r{idx}"
        if op == "grow":
            target = min(tokens.get(rid, 0) + n, 32)
            if bm.can_allocate(rid, target):
                bm.allocate(rid, target)
                tokens[rid] = target
                assert len(bm.block_table(rid)) * bm.block_size >= target
        else:
            bm.free(rid)
            tokens.pop(rid, None)
        bm.check_invariants()
        held = sum(len(bm.block_table(r)) for r in tokens)
        assert held + bm.num_free_blocks == bm.num_blocks
    for rid in list(tokens):
        bm.free(rid)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
