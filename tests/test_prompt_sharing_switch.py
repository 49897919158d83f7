"""EngineConfig.enable_prompt_sharing: the switch that shows parallel sampling's "before".
Off, the n sequences of a request each compute the whole prompt into their own blocks (no
fork, no copy-on-write) with the same seeds, so the tokens are those of the shared mode
(float32) while the peak blocks and the prompt tokens computed are higher; an abort leaks no
block either way."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig

BLOCK_SIZE = 4
# 30 token ids: 29 before the fork point, so the shared run's last prompt block is partial.
PROMPT_IDS = list(range(100, 130))
PARAMS = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)


def _llm(sharing: bool, **kwargs: object) -> LLM:
    return LLM(
        "random:tiny",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_model_len=64,
        enable_prompt_sharing=sharing,
        **kwargs,
    )


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {sharing: _llm(sharing) for sharing in (True, False)}


def _run(llm: LLM) -> tuple[list[list[int]], int, int, int]:
    """(each sample's tokens by index, peak blocks held, prompt tokens computed, copies)."""
    engine = llm.engine
    first_step = engine.num_steps
    copies_before = engine.block_manager.num_block_copies_total
    rid = engine.add_request(PROMPT_IDS, PARAMS)
    tokens: dict[int, list[int]] = {}
    peak_blocks = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id == rid
                tokens[out.index] = out.token_ids
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    steps = engine.stats().steps[-(engine.num_steps - first_step) :]
    prompt_tokens = sum(s.num_prefill_tokens for s in steps)
    copies = engine.block_manager.num_block_copies_total - copies_before
    return [tokens[i] for i in sorted(tokens)], peak_blocks, prompt_tokens, copies


def test_same_tokens_with_and_without_sharing_but_more_blocks_and_prefill(engines):
    shared_tokens, shared_peak, shared_prompt, shared_copies = _run(engines[True])
    alone_tokens, alone_peak, alone_prompt, alone_copies = _run(engines[False])
    assert len(shared_tokens) == PARAMS.n and len(set(map(tuple, shared_tokens))) > 1
    assert alone_tokens == shared_tokens  # seeds seed + i either way
    # Shared: the prompt but its last token once, then each sample's last prompt token.
    assert shared_prompt == len(PROMPT_IDS) - 1 + PARAMS.n
    assert alone_prompt == len(PROMPT_IDS) * PARAMS.n
    assert alone_peak > shared_peak
    assert shared_copies == PARAMS.n - 1 and alone_copies == 0  # no copy-on-write when off
    for llm in engines.values():
        stats = llm.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize(
    "kwargs",
    [{"enable_prefix_caching": True}, {"speculative_method": "ngram"}, {"batching": "static"}],
)
def test_without_sharing_with_other_engine_features(engines, kwargs):
    """The separate sequences go through prefix caching (a later one may hit an earlier
    one's full blocks), drafting and static batches like any request: same tokens."""
    expected = [o.token_ids for o in engines[True].generate([PROMPT_IDS], PARAMS)]
    llm = _llm(False, **kwargs)
    assert [o.token_ids for o in llm.generate([PROMPT_IDS], PARAMS)] == expected
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("num_steps", [0, 2, 6])
def test_abort_leaks_no_block(engines, sharing, num_steps):
    engine = engines[sharing].engine
    params = SamplingParams(n=3, max_tokens=20, temperature=0.8, seed=7)  # outlasts the steps
    rid = engine.add_request(PROMPT_IDS, params)
    for _ in range(num_steps):
        engine.step()
    out = engine.abort(rid)
    assert out is not None and out.request_finished
    assert not engine.has_unfinished() and rid not in engine._groups
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    engine.block_manager.check_invariants()


def test_the_switch_is_validated():
    with pytest.raises(ValueError, match=r"^enable_prompt_sharing:"):
        EngineConfig(model="random:tiny", enable_prompt_sharing="no")  # type: ignore[arg-type]
