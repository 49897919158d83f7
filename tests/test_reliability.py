"""Issue 11 (engine side): one bad request never fails the others, nothing hangs or spins,
and a failed step leaves no block behind."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engine import LLM, EngineConfig, EngineService, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.request import MAX_SEED, MAX_TOP_K, Request
from engine.runner import sampler

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


def test_step_or_raise_steps_until_stuck_then_raises(tiny_llm, monkeypatch):
    """The loop LLM.generate and the benchmarks share: ordinary steps pass through; a step
    that schedules nothing while a request waits raises instead of returning [] forever."""
    engine = tiny_llm.engine
    request = engine.make_request([1, 2, 3], GREEDY)
    engine.add(request)
    assert engine.step_or_raise() is not None  # the prompt's step: scheduled, no error
    monkeypatch.setattr(engine.scheduler, "schedule", lambda *a, **k: SchedulerOutput())
    with pytest.raises(RuntimeError, match="none can be scheduled"):
        engine.step_or_raise()
    monkeypatch.undo()
    while engine.has_unfinished():  # the request was left as it was: it runs to its end
        engine.step_or_raise()
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


def _poisoned_uniform(real):
    """sampler.uniform (every sampled token's one random draw, wherever sampling happens) that
    raises for the request seeded POISON_SEED: validation cannot catch it, as with a sampler
    bug hit by one request."""

    def uniform(generator):
        if generator is not None and generator.initial_seed() == POISON_SEED:
            raise RuntimeError("injected sampling failure")
        return real(generator)

    return uniform


def test_one_poisoned_request_leaves_the_others_complete_and_exact(monkeypatch):
    with EngineService(EngineConfig(**TINY)) as svc:
        reference = [svc.submit(p, GREEDY).result().token_ids for p in PROMPTS]
        monkeypatch.setattr(sampler, "uniform", _poisoned_uniform(sampler.uniform))
        poison = SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED)
        streams = [svc.submit(p, GREEDY) for p in PROMPTS]
        bad = svc.submit([7, 8, 9], poison)
        finals = [s.result() for s in streams]
        bad_final = bad.result()
        assert bad_final.finished and bad_final.error
        assert (
            "sampling failed" in bad_final.error and "injected sampling failure" in bad_final.error
        )
        assert [f.token_ids for f in finals] == reference
        assert all(f.error is None and f.finish_reason == "length" for f in finals)
        wait_all_blocks_free(svc)
        assert svc.stats().num_step_failures_total == 0  # one request failed, not a step


def _assert_clean(engine) -> None:
    """No request left, every block free, the block manager's books consistent."""
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_poisoned_sampling_fails_alone_and_seeded_neighbours_stay_exact(llm_f32, monkeypatch):
    """The embedded model in float32: a greedy and a seeded request sampled in the same batch
    as a request whose draw raises get exactly their tokens and text from alone. The seeded one
    draws before the poisoned row, so this also checks that its generator is replayed from its
    pre-batch state (drawn twice, it would continue differently)."""
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    params = [seeded, GREEDY]
    alone = llm_f32.generate(prompts[:2], params)
    monkeypatch.setattr(sampler, "uniform", _poisoned_uniform(sampler.uniform))
    poison = SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED)
    mixed = llm_f32.generate(prompts, [*params, poison])
    assert [(o.token_ids, o.text) for o in mixed[:2]] == [(o.token_ids, o.text) for o in alone]
    assert all(o.error is None and o.finish_reason == "length" for o in mixed[:2])
    bad = mixed[2]
    assert bad.finished and bad.finish_reason == "abort" and bad.token_ids == []
    assert bad.error == "engine error: sampling failed: RuntimeError: injected sampling failure"
    _assert_clean(llm_f32.engine)


@pytest.mark.parametrize("max_tokens", [1, 8], ids=["finishing-that-step", "mid-generation"])
def test_a_request_whose_detokenizing_raises_fails_alone(tiny_llm, monkeypatch, max_tokens):
    """With max_tokens=1 the bad request hits its length limit in the same step (its blocks
    are already free when detokenizing raises); with 8 it is still running and is aborted."""
    import engine.core.output as output_module

    real = output_module.detokenize_new
    marker = 7  # the first prompt token of the request whose detokenizing raises

    def detokenize_new(tokenizer, request, final=False):
        if request.prompt_token_ids[0] == marker and request.num_output_tokens >= 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return real(tokenizer, request, final=final)

    alone = tiny_llm.generate(PROMPTS[:3], GREEDY)
    monkeypatch.setattr(output_module, "detokenize_new", detokenize_new)
    bad_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    mixed = tiny_llm.generate([*PROMPTS[:3], [marker, 8, 9]], [GREEDY] * 3 + [bad_params])
    assert [(o.token_ids, o.text) for o in mixed[:3]] == [(o.token_ids, o.text) for o in alone]
    assert all(o.error is None and o.finish_reason == "length" for o in mixed[:3])
    bad = mixed[3]
    assert bad.finished and bad.finish_reason == "abort"
    assert bad.error.startswith("engine error: detokenizing failed: UnicodeDecodeError")
    assert "injected detokenizer failure" in bad.error
    _assert_clean(tiny_llm.engine)


def _fail_forward_at(model, monkeypatch, call: int) -> list[int]:
    """Make the model's `call`-th forward pass from now raise (once); returns the call count."""
    real_forward = model.forward
    calls = [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("injected forward failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return calls


def _step_failures_metric(engine) -> float:
    text = engine.metrics_registry.render().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("playground:engine_step_failures"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("fail_at", [1, 3], ids=["first-prefill", "mid-decode"])
def test_a_failed_forward_fails_that_steps_requests_only(make_llm, monkeypatch, caplog, fail_at):
    """max_num_seqs=2: the third request waits outside the failed step and completes exactly;
    the two in it get the error; no block leaks; the failure is logged once, counted in
    EngineStats and in Prometheus; and the engine serves exactly afterwards."""
    llm = make_llm(**TINY, max_num_seqs=2)
    engine = llm.engine
    alone = llm.generate(PROMPTS[:3], GREEDY)
    failures_before = engine.stats().num_step_failures_total
    metric_before = _step_failures_metric(engine)
    _fail_forward_at(engine.runner.model, monkeypatch, fail_at)
    with caplog.at_level("ERROR", logger="engine.core.engine"):
        outs = llm.generate(PROMPTS[:3], GREEDY)
    for out in outs[:2]:
        assert out.finished and out.finish_reason == "abort"
        assert (
            out.error == "engine error: forward pass failed: RuntimeError: injected forward failure"
        )
        assert len(out.token_ids) == fail_at - 1  # one token per forward before it
    assert outs[2].token_ids == alone[2].token_ids and outs[2].error is None
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "injected forward failure" in caplog.text
    assert engine.stats().num_step_failures_total == failures_before + 1
    assert _step_failures_metric(engine) == metric_before + 1
    _assert_clean(engine)
    again = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in alone]
    assert all(o.error is None for o in again)
    _assert_clean(engine)


def test_service_delivers_an_engine_error_to_the_poisoned_stream_only(monkeypatch):
    """Through EngineService, consumed as async streams: a stream whose detokenizing raises
    ends with the error while the others stream to completion, exactly; the engine thread
    stays alive and serves the next requests."""
    import asyncio

    import engine.core.output as output_module

    real = output_module.detokenize_new

    def detokenize_new(tokenizer, request, final=False):
        if request.prompt_token_ids[0] == 7 and request.num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer failure")
        return real(tokenizer, request, final=final)

    async def consume(stream):
        return [delta async for delta in stream]

    async def run_all(streams):
        return await asyncio.gather(*(consume(s) for s in streams))

    with EngineService(EngineConfig(**TINY)) as svc:
        reference = [svc.submit(p, GREEDY).result().token_ids for p in PROMPTS]
        monkeypatch.setattr(output_module, "detokenize_new", detokenize_new)
        streams = [svc.submit(p, GREEDY) for p in PROMPTS[:3]]
        streams.insert(1, svc.submit([7, 8, 9], GREEDY))
        streams += [svc.submit(p, GREEDY) for p in PROMPTS[3:]]
        deltas = asyncio.run(run_all(streams))
        bad = deltas.pop(1)
        assert [d[-1].token_ids for d in deltas] == reference
        assert all(d[-1].error is None and d[-1].finish_reason == "length" for d in deltas)
        assert all(delta.error is None for d in deltas for delta in d)
        assert bad[-1].finished and "injected detokenizer failure" in bad[-1].error
        assert [d.error for d in bad[:-1]] == [None] * (len(bad) - 1)
        assert svc.is_alive()
        wait_all_blocks_free(svc)
        monkeypatch.undo()
        after = [svc.submit(p, GREEDY).result() for p in PROMPTS[:2]]
        assert [o.token_ids for o in after] == reference[:2]
        wait_all_blocks_free(svc)
        with svc._lock:
            svc.engine.block_manager.check_invariants()


def test_a_request_whose_draft_verification_raises_fails_alone(make_llm, monkeypatch):
    """Speculative decoding: every decoding request verifies a draft; the one whose verifier
    raises fails alone and the others get exactly the tokens they get without it."""
    import engine.runner.model_runner as runner_module

    llm = make_llm(**TINY, speculative_method="ngram")
    engine = llm.engine
    monkeypatch.setattr(
        engine.proposer,
        "propose",
        lambda running: {
            r.request_id: [21, 22] for r in running if r.num_computed_tokens + 1 == r.num_tokens
        },
    )
    real_verify = runner_module.verify

    def verify(logits, draft, params, generator, history=(), draft_probs=None, masked=None):
        if history.token_ids and history.token_ids[0] == 7:  # repetition_penalty set
            raise RuntimeError("injected verify failure")
        return real_verify(logits, draft, params, generator, history, draft_probs, masked)

    monkeypatch.setattr(runner_module, "verify", verify)
    alone = llm.generate(PROMPTS[:3], GREEDY)
    bad_params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.1
    )
    stats_before = engine.stats()
    mixed = llm.generate([*PROMPTS[:3], [7, 8, 9]], [GREEDY] * 3 + [bad_params])
    assert engine.stats().num_draft_tokens_total > stats_before.num_draft_tokens_total
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert all(o.error is None and o.finish_reason == "length" for o in mixed[:3])
    bad = mixed[3]
    assert bad.finished and bad.finish_reason == "abort" and len(bad.token_ids) == 1
    assert (
        bad.error
        == "engine error: draft verification failed: RuntimeError: injected verify failure"
    )
    _assert_clean(engine)
