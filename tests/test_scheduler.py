"""Scheduler mechanics without a model: budgets, chunking, preemption, static batches, stops."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestStatus, SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        arrival_time=0.0,
        eos_token_ids=(0,),
        max_total_tokens=prompt_len + max_tokens,
    )


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, kw.pop("layout", "paged"), max_model_len=128)
    return Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, **kw)


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    return out


def test_prefill_then_decode():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [10]
    assert out.num_prefill_tokens == 10
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [1] and out.num_decode_tokens == 1


def test_a_one_token_last_chunk_is_still_prefill():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 9))
    run_step(sched)  # 8 prompt tokens
    out = run_step(sched)  # the 9th: one new token, but the prompt's, not a generated one
    assert out.scheduled[0].num_new_tokens == 1
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)
    out = run_step(sched)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


def test_chunked_prefill_respects_budget():
    sched = make_scheduler(budget=4)
    sched.add_request(make_request("a", 10))
    chunks = [run_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [4, 4, 2]
    req = sched.running[0]
    assert req.num_output_tokens == 1  # only the last chunk samples


def test_continuous_batching_admits_while_others_decode():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=10))
    run_step(sched)
    sched.add_request(make_request("b", 4))
    out = run_step(sched)
    assert {s.request.request_id for s in out.scheduled} == {"a", "b"}


def test_static_batching_waits_for_the_whole_batch():
    sched = make_scheduler(batching="static")
    sched.add_request(make_request("a", 4, max_tokens=5))
    run_step(sched)
    sched.add_request(make_request("b", 4, max_tokens=1))
    for _ in range(4):
        out = run_step(sched)
        assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert not sched.running  # "a" finished: only now may "b" start
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["b"]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 4))
    assert len(run_step(sched).scheduled) == 2


def test_preempts_newest_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens of KV in all
    sched.add_request(make_request("old", 7, max_tokens=20))
    sched.add_request(make_request("new", 7, max_tokens=20))
    run_step(sched)  # both prefilled: 2 blocks each, all 4 used
    preempted = []
    for _ in range(3):
        preempted += run_step(sched).preempted_ids
    assert preempted == ["new"]
    new = next(r for r in sched.waiting if r.request_id == "new")
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.metrics.num_preemptions == 1
    assert sched.block_manager.block_table("new") == []


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 4, max_tokens=10))
    run_step(sched, token=0)
    assert sched.block_manager.num_free_blocks == 64  # finished and freed
    sched.add_request(make_request("ignore", 4, max_tokens=2, ignore_eos=True))
    run_step(sched, token=0)
    assert sched.running and sched.running[0].num_output_tokens == 1
    run_step(sched, token=0)
    assert not sched.running  # max_tokens


def test_abort_frees_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    run_step(sched)
    assert sched.abort("a").status is RequestStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_blocks == 64
    assert sched.abort("a") is None


@settings(max_examples=60, deadline=None)
@given(
    actions=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]),
            st.integers(1, 30),  # prompt length
            st.integers(1, 12),  # max tokens / abort index
        ),
        max_size=60,
    ),
    batching=st.sampled_from(["continuous", "static"]),
    layout=st.sampled_from(["paged", "contiguous"]),
)
def test_random_workloads_never_leak_blocks(actions, batching, layout):
    bm_blocks = 16
    sched = make_scheduler(
        num_blocks=bm_blocks, block_size=4, budget=16, max_seqs=4, batching=batching,
        layout=layout,
    )  # fmt: skip
    sched.block_manager.reserved_blocks_per_request = 8 if layout == "contiguous" else 0
    ids = []
    for i, (op, a, b) in enumerate(actions):
        if op == "add":
            request = make_request(f"r{i}", a, max_tokens=b)
            # What the engine's admission check guarantees: a request fits when alone.
            if sched.block_manager.max_blocks_for(a + b) <= bm_blocks:
                sched.add_request(request)
                ids.append(request.request_id)
        elif op == "abort" and ids:
            sched.abort(ids[b % len(ids)])
        else:
            run_step(sched)
        sched.block_manager.check_invariants()
    for _ in range(500):
        if not sched.has_work():
            break
        run_step(sched)
    assert not sched.has_work(), "requests left unfinished (livelock)"
    assert sched.block_manager.num_free_blocks == bm_blocks
    sched.block_manager.check_invariants()
