"""Issue 11 (engine side): one bad request never fails the others, nothing hangs or spins,
and a failed step leaves no block behind."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from engine import LLM, EngineConfig, EngineService, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.request import MAX_SEED, MAX_TOP_K, Request

TINY = dict(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=64)
PROMPTS = [[11 + i, 12, 13, 14, 15 + i] for i in range(6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POISON_SEED = 13  # the seed of the request whose sampling is made to raise


def wait_all_blocks_free(service: EngineService, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = service.stats()
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == 0:
            return
        assert time.monotonic() < deadline, f"blocks held: {s.num_kv_blocks - s.num_free_kv_blocks}"
        time.sleep(0.02)


# --- bounds, end to end ---


@pytest.mark.parametrize(
    "edge",
    [
        dict(seed=MAX_SEED, temperature=1.0),
        dict(seed=0, temperature=1.0),
        dict(top_k=MAX_TOP_K, temperature=1.0, seed=1),
        dict(temperature=0.01, seed=1),
        dict(temperature=100.0, seed=1),
        dict(repetition_penalty=0.01, temperature=1.0, seed=1),
        dict(repetition_penalty=100.0, temperature=1.0, seed=1),
        dict(repetition_penalty=0.01, temperature=0.0),
        dict(top_p=1e-6, temperature=1.0, seed=1),
        dict(min_p=1.0, temperature=1.0, seed=1),
    ],
)
def test_every_bound_runs_end_to_end_next_to_normal_requests(tiny_llm, edge):
    """A request at each documented edge samples without error in a batch of normal ones,
    and the normal ones get exactly the tokens they get alone."""
    alone = tiny_llm.generate(PROMPTS[:3], GREEDY)
    edge_params = SamplingParams(max_tokens=8, ignore_eos=True, **edge)
    mixed = tiny_llm.generate([*PROMPTS[:3], PROMPTS[3]], [GREEDY] * 3 + [edge_params])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert len(mixed[3].token_ids) == 8 and mixed[3].error is None
    assert all(0 <= t < 49152 for t in mixed[3].token_ids)
    stats = tiny_llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# --- issue 2: no hang without chunked prefill ---


def test_prompt_over_the_budget_without_chunking_is_rejected_naming_prompt():
    llm = LLM(model="random:tiny", enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"^prompt: 40 tokens exceed max_num_batched_tokens=16"):
        llm.generate([[504] * 40])
    # Within the budget it runs (the limit is on one step's work, not on the output).
    out = llm.generate([[504] * 16], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 20
    assert not llm.engine.has_unfinished()


def _request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=0.0,
        eos_token_ids=(0,), max_total_tokens=prompt_len + max_tokens,
    )  # fmt: skip


def test_unchunked_work_over_the_budget_runs_alone_instead_of_blocking_the_queue():
    """A preempted request recomputes prompt + output, which can exceed the budget that its
    prompt alone fit in: it must run (alone) rather than wait forever with the queue behind."""
    bm = BlockManager(64, 4, "paged", max_model_len=128)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(_request("small", 4))
    out = sched.schedule()
    sched.update(out, {"small": [7]})
    sched.add_request(_request("big", 20))  # e.g. 12 prompt + 8 output, preempted
    sched.add_request(_request("after", 4))
    seen: list[list[tuple[str, int]]] = []
    for _ in range(10):
        out = sched.schedule()
        if out.is_empty:
            break
        seen.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        sched.update(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
    # While "small" decodes, "big" waits (FCFS: "after" waits behind it); then "big" runs
    # alone over the budget, and "after" follows.
    assert seen[0] == [("small", 1)]
    assert ("big", 20) in [item for step in seen for item in step]
    big_step = next(step for step in seen if ("big", 20) in step)
    assert big_step == [("big", 20)]
    assert any(("after", 4) in step for step in seen)
    assert not sched.has_work()
    assert bm.num_free_blocks == 64


def test_llm_generate_raises_instead_of_hanging_when_nothing_is_schedulable(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.engine.scheduler, "schedule", lambda *a, **k: SchedulerOutput())
    result: list[BaseException] = []

    def run() -> None:
        try:
            tiny_llm.generate([[1, 2, 3]], GREEDY)
        except BaseException as exc:  # handed to the test thread
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "LLM.generate hung with nothing schedulable"
    assert isinstance(result[0], RuntimeError)
    monkeypatch.undo()
    assert not tiny_llm.engine.has_unfinished()
    stats = tiny_llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_service_loop_does_not_spin_when_nothing_is_schedulable():
    with EngineService(EngineConfig(**TINY)) as svc:
        real = svc.engine.scheduler.schedule
        calls = 0

        def empty(*args, **kwargs):
            nonlocal calls
            calls += 1
            return SchedulerOutput()

        svc.engine.scheduler.schedule = empty
        stream = svc.submit([1, 2, 3], GREEDY)
        time.sleep(1.0)
        # A spinning loop calls schedule() hundreds of thousands of times a second.
        assert calls <= 40, f"the engine loop spun: {calls} schedule() calls in 1 s"
        svc.engine.scheduler.schedule = real
        svc.abort(stream.request_id)  # also wakes the loop
        assert stream.result().finished
        wait_all_blocks_free(svc)


# --- issue 8: chat's default max_tokens fits the pool ---


def test_chat_without_max_tokens_on_a_small_pool_gets_what_fits():
    from engine.serving.http_server import BackgroundServer
    from engine.serving.server import create_app

    config = EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=8, block_size=16)
    with EngineService(config) as svc:
        pool_tokens = 8 * 16
        assert svc.engine.max_new_tokens(100) == pool_tokens - 100
        assert svc.engine.max_new_tokens(pool_tokens + 5) == 1
        server = BackgroundServer(create_app(svc)).start()
        try:
            body = {
                "model": svc.model_name,
                "messages": [{"role": "user", "content": "Say hello"}],
                "temperature": 0,
                "ignore_eos": True,
            }
            resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        finally:
            server.stop()
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == pool_tokens
        assert resp.json()["choices"][0]["finish_reason"] == "length"
        wait_all_blocks_free(svc)


# --- a failed step leaves nothing behind ---


def test_a_failed_forward_pass_frees_everything_and_the_service_goes_on(monkeypatch):
    with EngineService(EngineConfig(**TINY)) as svc:
        model = svc.engine.runner.model
        real_forward = model.forward
        fail = threading.Event()

        def flaky(*args, **kwargs):
            if fail.is_set():
                fail.clear()
                raise RuntimeError("injected forward failure")
            return real_forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", flaky)
        fail.set()
        streams = [svc.submit(p, GREEDY) for p in PROMPTS[:3]]
        finals = [s.result() for s in streams]
        assert all(f.finished for f in finals)
        assert any(f.error and "injected forward failure" in f.error for f in finals)
        wait_all_blocks_free(svc)
        # The engine is consistent afterwards: the same prompts now complete exactly.
        again = [svc.submit(p, GREEDY).result() for p in PROMPTS[:3]]
        assert all(len(o.token_ids) == 8 and o.error is None for o in again)
        wait_all_blocks_free(svc)


# --- issue 11 (b): one poisoned request among N normal ones ---


def _poisoned_multinomial(real):
    """torch.multinomial that raises for the request seeded POISON_SEED, wherever sampling
    happens: validation cannot catch it, as with a sampler bug hit by one request."""

    def multinomial(probs, num_samples, *args, generator=None, **kwargs):
        if generator is not None and generator.initial_seed() == POISON_SEED:
            raise RuntimeError("injected sampling failure")
        return real(probs, num_samples, *args, generator=generator, **kwargs)

    return multinomial


def test_one_poisoned_request_leaves_the_others_complete_and_exact(monkeypatch):
    with EngineService(EngineConfig(**TINY)) as svc:
        reference = [svc.submit(p, GREEDY).result().token_ids for p in PROMPTS]
        monkeypatch.setattr(torch, "multinomial", _poisoned_multinomial(torch.multinomial))
        poison = SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED)
        streams = [svc.submit(p, GREEDY) for p in PROMPTS]
        bad = svc.submit([7, 8, 9], poison)
        finals = [s.result() for s in streams]
        bad_final = bad.result()
        assert bad_final.finished and bad_final.error
        assert [f.token_ids for f in finals] == reference
        assert all(f.error is None and f.finish_reason == "length" for f in finals)
        wait_all_blocks_free(svc)
