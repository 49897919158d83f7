"""Load generator unit tests: workloads, arrivals, metric definitions, goodput, JSONL parsing,
the driver and the HTTP client, all without a model."""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import time

import httpx
import numpy as np
import pytest

from playground.loadgen import (
    EngineTarget,
    GenRequest,
    LengthDist,
    LoadTestResult,
    OpenAITarget,
    RequestResult,
    WorkloadSpec,
    arrival_offsets_s,
    build_requests,
    compute_summary,
    format_summary_table,
    load_dataset,
    parse_slos,
    run_load_test,
)
from playground.loadgen.metrics import meets_slos
from playground.loadgen.run import build_parser, length_dist_from_args, spec_from_args
from playground.loadgen.workload import build_warmup_requests, parse_dataset_record
from playground.remote.client import OpenAIClient, StreamReply


class FakeTokenizer:
    vocab_size = 1000
    all_special_ids = [0, 1, 2]  # noqa: RUF012

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + len(w) for w in text.split()]


# --- arrivals --------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_are_gamma_with_mean_one_over_rate(burstiness):
    rate = 20.0
    offsets = arrival_offsets_s(20_000, rate, burstiness, seed=3)
    assert offsets[0] == 0.0
    gaps = np.diff(offsets)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # Gamma(k, θ): coefficient of variation 1/sqrt(k); 1 for Poisson arrivals.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_and_inf_rate_sends_all_at_once():
    a = arrival_offsets_s(50, 5.0, 1.0, seed=7)
    assert np.array_equal(a, arrival_offsets_s(50, 5.0, 1.0, seed=7))
    assert not np.array_equal(a, arrival_offsets_s(50, 5.0, 1.0, seed=8))
    assert np.array_equal(arrival_offsets_s(10, math.inf), np.zeros(10))


# --- length distributions --------------------------------------------------------------------


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.fixed(7).sample(rng, 3) == [7, 7, 7]
    uni = LengthDist.uniform(16, 20).sample(rng, 2000)
    assert min(uni) == 16 and max(uni) == 20  # both bounds inclusive
    assert set(uni) == set(range(16, 21))
    norm = np.array(LengthDist.normal(100, 10).sample(rng, 5000))
    assert norm.mean() == pytest.approx(100, abs=1)
    assert norm.std() == pytest.approx(10, rel=0.05)
    clipped = LengthDist.normal(5, 20, low=2, high=9).sample(rng, 1000)
    assert min(clipped) == 2 and max(clipped) == 9


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "uniform", "mean": 5}, "low/high"),
        ({"kind": "normal", "mean": 5}, "std"),
        ({"kind": "fixed", "mean": 0}, "mean"),
        ({"kind": "poisson"}, "kind"),
        ({"kind": "uniform", "mean": 5, "low": 9, "high": 3}, "low/high"),
    ],
)
def test_bad_length_distributions_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LengthDist(**kwargs)


def test_cli_length_options():
    assert length_dist_from_args(32, None, None, None, "input") == LengthDist.fixed(32)
    assert length_dist_from_args(32, None, "16:64", None, "input") == LengthDist.uniform(16, 64)
    assert length_dist_from_args(32, None, None, 4.0, "input") == LengthDist.normal(32, 4.0)
    with pytest.raises(ValueError, match="--output-len-range"):
        length_dist_from_args(32, "uniform", None, None, "output")
    with pytest.raises(ValueError, match="LO:HI"):
        length_dist_from_args(32, None, "16", None, "input")
    args = build_parser().parse_args(
        shlex.split(
            "--num-prompts 5 --request-rate 2 --input-len-range 4:8 --output-len 3 "
            "--prefix-len 2 --no-ignore-eos --max-concurrency 2"
        )
    )
    spec = spec_from_args(args)
    assert spec.input_len == LengthDist.uniform(4, 8) and spec.output_len == LengthDist.fixed(3)
    assert (spec.num_prompts, spec.request_rate, spec.max_concurrency) == (5, 2.0, 2)
    assert spec.prefix_len == 2 and spec.ignore_eos is False


def test_workload_spec_validation():
    assert WorkloadSpec(input_len=12).input_len == LengthDist.fixed(12)
    for bad in (
        {"num_prompts": 0},
        {"request_rate": 0},
        {"burstiness": 0},
        {"max_concurrency": 0},
        {"prefix_len": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WorkloadSpec(**bad)


# --- requests --------------------------------------------------------------------------------


def test_random_requests_have_exact_lengths_shared_prefix_and_no_special_tokens():
    spec = WorkloadSpec(
        num_prompts=50, input_len=LengthDist.uniform(3, 9), output_len=LengthDist.uniform(1, 4),
        prefix_len=5, seed=1,
    )  # fmt: skip
    reqs = build_requests(spec, FakeTokenizer())
    assert [r.index for r in reqs] == list(range(50))
    prefix = reqs[0].prompt[:5]
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 5 + 3 <= r.prompt_len <= 5 + 9 and 1 <= r.output_len <= 4
        assert r.prompt[:5] == prefix
        assert not {0, 1, 2} & set(r.prompt) and max(r.prompt) < 1000
    assert build_requests(spec, FakeTokenizer()) == reqs  # seeded
    assert build_requests(spec.replace(seed=2), FakeTokenizer()) != reqs
    warm = build_warmup_requests(spec.replace(num_warmups=3), FakeTokenizer())
    assert len(warm) == 3 and all(w.prompt[:5] != prefix for w in warm)


def test_dataset_requests_cycle_through_a_shuffled_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "one two"}\n{"prompt": "three", "max_tokens": 9}\n')
    spec = WorkloadSpec(num_prompts=5, dataset=str(path), output_len=4)
    reqs = build_requests(spec, FakeTokenizer())
    texts = [r.prompt for r in reqs]
    assert sorted(texts[:2]) == ["one two", "three"] and sorted(texts[2:4]) == sorted(texts[:2])
    for r in reqs:
        assert r.prompt_len == len(r.prompt.split())
        assert r.output_len == (9 if r.prompt == "three" else 4)
    with_prefix = build_requests(spec.replace(prefix_len=3), FakeTokenizer())
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in with_prefix)


# --- JSONL parsing ---------------------------------------------------------------------------


def test_dataset_record_shapes():
    assert parse_dataset_record({"prompt": "hi"}).text == "hi"
    assert parse_dataset_record({"prompt": "hi", "output_len": 7}).output_len == 7
    sharegpt = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "question?"},
            {"from": "gpt", "value": "answer"},
        ],
    }
    assert parse_dataset_record(sharegpt).text == "question?"
    openai_style = {"conversations": [{"role": "user", "content": "q2"}]}
    assert parse_dataset_record(openai_style).text == "q2"
    assert parse_dataset_record({"messages": [{"role": "user", "content": "q3"}]}).text == "q3"
    assert parse_dataset_record({"conversations": [{"from": "gpt", "value": "a"}]}) is None
    assert parse_dataset_record({"prompt": "  "}) is None
    assert parse_dataset_record(42) is None


def test_load_dataset_jsonl_and_json_array(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        '{"prompt": "a"}\n\n{"conversations": []}\n'
        '{"conversations": [{"from": "human", "value": "b"}]}\n'
    )
    assert [p.text for p in load_dataset(jsonl)] == ["a", "b"]
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps([{"conversations": [{"from": "human", "value": "c"}]}]))
    assert [p.text for p in load_dataset(array)] == ["c"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{nope\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2"):
        load_dataset(broken)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="no usable prompt"):
        load_dataset(empty)


# --- metric definitions ----------------------------------------------------------------------


def _result(index, send, chunks, end, out, prompt=10, error=None):
    return RequestResult(
        index, send, chunks[0] if chunks else None, end, list(chunks), prompt, out, error
    )


def test_request_metric_definitions():
    # 3 chunks carrying 5 tokens (usage says 5): TPOT uses tokens, ITL uses chunk gaps.
    r = _result(0, 10.0, [10.1, 10.15, 10.25], 10.3, out=5)
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.3)
    assert r.itl_s == pytest.approx([0.05, 0.1])
    assert r.tpot_s == pytest.approx((0.3 - 0.1) / 4)
    assert _result(1, 0.0, [0.2], 0.2, out=1).tpot_s is None


def test_summary_on_synthetic_timings():
    results = [
        _result(0, 0.0, [0.1, 0.2, 0.3], 0.3, out=3, prompt=10),
        _result(1, 0.5, [0.9, 1.0], 1.0, out=2, prompt=20),
        _result(2, 1.0, [1.2], 1.2, out=1, prompt=30),
        _result(3, 1.0, [], 1.1, out=0, error="HTTP 400: prompt: too long"),
        _result(4, 1.0, [], 1.1, out=0, error="HTTP 400: prompt: too long"),
    ]
    s = compute_summary(results, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 2)
    assert s["errors"] == {"HTTP 400: prompt: too long": 2}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 6)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(33.0)
    ttfts_ms = [100.0, 400.0, 200.0]
    assert s["mean_ttft_ms"] == pytest.approx(np.mean(ttfts_ms))
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 90))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 99))
    # TPOT only for requests with >= 2 output tokens: (0.3-0.1)/2 and (0.5-0.4)/1.
    assert s["mean_tpot_ms"] == pytest.approx((100.0 + 100.0) / 2)
    assert s["mean_itl_ms"] == pytest.approx(100.0)  # gaps 0.1, 0.1, 0.1 pooled
    assert s["mean_e2el_ms"] == pytest.approx((300 + 500 + 200) / 3)
    assert s["goodput"] is None and "mean_queue_ms" not in s
    table = format_summary_table(s)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    empty = compute_summary([], duration_s=0.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None
    format_summary_table(empty)


def test_goodput():
    assert parse_slos(["ttft:500", "tpot:50", "e2el:1e4"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 10000.0,
    }  # fmt: skip
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_slos(bad)
    fast = _result(0, 0.0, [0.1, 0.12], 0.12, out=2)  # ttft 100 ms, tpot 20 ms
    slow_first = _result(1, 0.0, [0.6, 0.62], 0.62, out=2)  # ttft 600 ms
    slow_decode = _result(2, 0.0, [0.1, 0.2], 0.2, out=2)  # tpot 100 ms
    one_token = _result(3, 0.0, [0.1], 0.1, out=1)  # no TPOT: counts as meeting it
    failed = _result(4, 0.0, [], 0.1, out=0, error="x")
    slos = {"ttft": 500, "tpot": 50}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, one_token, failed)] == [
        True, False, False, True, False,
    ]  # fmt: skip
    s = compute_summary([fast, slow_first, slow_decode, one_token, failed], 2.0, slos)
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert compute_summary([fast], 1.0, {"e2el": 100})["good_requests"] == 0


# --- the driver ------------------------------------------------------------------------------


class FakeTarget:
    """Answers after a fixed service time; tracks concurrency."""

    name = "fake"
    tokenizer = FakeTokenizer()

    def __init__(self, service_s=0.01):
        self.service_s = service_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent: list[GenRequest] = []
        self.closed = False

    async def send(self, request, spec):
        self.sent.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        send = time.perf_counter()
        await asyncio.sleep(self.service_s)
        first = time.perf_counter()
        await asyncio.sleep(self.service_s)
        end = time.perf_counter()
        self.in_flight -= 1
        return RequestResult(
            request.index, send, first, end, [first, end], request.prompt_len, request.output_len
        )

    async def aclose(self):
        self.closed = True


def test_run_load_test_limits_concurrency_and_reports_progress():
    spec = WorkloadSpec(num_prompts=40, max_concurrency=4, input_len=8, output_len=2, num_warmups=3)
    target = FakeTarget()
    progress = []
    result = asyncio.run(
        run_load_test(spec, target, on_progress=lambda d, t, r: progress.append((d, t, r.index)))
    )
    assert isinstance(result, LoadTestResult)
    assert target.max_in_flight == 4 and target.closed
    assert len(target.sent) == 43  # 3 warm-ups + 40 measured
    assert [r.index for r in result.per_request] == list(range(40))
    assert [d for d, _, _ in progress] == list(range(1, 41)) and {t for _, t, _ in progress} == {40}
    s = result.summary()
    assert s["completed"] == 40 and s["total_output_tokens"] == 80
    # 40 requests of ~20 ms, 4 at a time: ~0.2 s.
    assert 0.15 < result.duration_s < 2.0
    payload = json.loads(result.to_json())
    assert payload["summary"]["completed"] == 40 and len(payload["per_request"]) == 40
    assert payload["spec"]["request_rate"] == "inf"


def test_run_load_test_follows_the_arrival_schedule():
    spec = WorkloadSpec(num_prompts=6, request_rate=20.0, input_len=4, output_len=1, seed=5)
    target = FakeTarget(service_s=0.0)
    progress_awaited = []

    async def on_progress(done, total, last):  # coroutine callbacks are awaited
        progress_awaited.append(done)

    result = asyncio.run(run_load_test(spec, target, on_progress=on_progress))
    offsets = arrival_offsets_s(6, 20.0, 1.0, seed=5)
    sends = np.array([r.send_time for r in result.per_request]) - result.start_time
    assert np.all(sends >= offsets - 1e-3)
    assert np.all(sends <= offsets + 0.1)
    assert progress_awaited == [1, 2, 3, 4, 5, 6]


# --- the HTTP client, against a scripted SSE server -----------------------------------------


def _sse(*chunks):
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_openai_target_streams_and_counts_usage_tokens():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"] = str(request.url)
        seen["auth"] = request.headers.get("authorization")
        seen["body"] = json.loads(request.content)
        text = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in "ab"]
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
        first = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        return httpx.Response(200, text=_sse(first, *text, last, usage))

    async def go():
        client = OpenAIClient("http://x:1/v1", "k", transport=httpx.MockTransport(handler))
        target = OpenAITarget("http://x:1/v1", "m", tokenizer=FakeTokenizer(), client=client)
        spec = WorkloadSpec(num_prompts=1, output_len=3)
        r = await target.send(GenRequest(0, [5, 6, 7, 8], 4, 3), spec)
        await target.aclose()
        return r

    r = asyncio.run(go())
    assert seen["url"] == "http://x:1/v1/completions"
    body = seen["body"]
    assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 3 and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert r.success and r.output_tokens == 3 and r.prompt_tokens == 4  # from usage
    assert len(r.token_times) == 2  # empty chunks are not tokens
    assert r.finish_reason == "length"


def test_openai_target_reports_http_errors():
    def handler(request):
        err = {"error": {"message": "prompt: too long", "type": "invalid_request_error"}}
        return httpx.Response(400, json=err)

    async def go():
        client = OpenAIClient("http://x:1", transport=httpx.MockTransport(handler))
        target = OpenAITarget("http://x:1", "m", tokenizer=FakeTokenizer(), client=client)
        return await target.send(GenRequest(0, "hi", 1, 3), WorkloadSpec())

    r = asyncio.run(go())
    assert not r.success and r.error == "HTTP 400: prompt: too long"


def test_one_client_reads_chat_streams_stream_errors_and_counts_chunks_without_usage():
    """The client remote chat and OpenAITarget share: chat deltas and completion text both
    count as content; an error chunk ends the reply with its message; without a usage report
    the tokens are the content chunks."""
    chunks = [
        {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        *({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": t}}]} for t in "ab"),
        {"error": {"message": "engine: out of blocks"}},
        {"choices": [{"index": 0, "delta": {"content": "never read"}}]},
    ]

    def handler(request):
        return httpx.Response(200, text=_sse(*chunks))

    async def go():
        client = OpenAIClient("http://x:1", transport=httpx.MockTransport(handler))
        reply, seen = StreamReply(send_time=time.perf_counter()), []
        await client.stream("chat/completions", {}, reply, lambda r: seen.append(r.text))
        await client.aclose()
        return reply, seen

    reply, seen = asyncio.run(go())
    assert seen == ["a", "ab"] and reply.text == "ab" and reply.request_id == "chatcmpl-1"
    assert reply.error == "stream error: engine: out of blocks"
    metrics = reply.metrics(reply.content_times[-1] + 1.0)
    assert metrics.num_tokens == 2 and not metrics.tokens_from_usage
    assert metrics.ttft_s == pytest.approx(reply.content_times[0] - reply.send_time)


def test_sampling_options_reach_both_targets():
    args = build_parser().parse_args(
        shlex.split("--temperature 0.8 --top-p 0.9 --top-k 20 --min-p 0.05")
    )
    spec = spec_from_args(args)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p) == (0.8, 0.9, 20, 0.05)
    request = build_requests(WorkloadSpec(num_prompts=1, input_len=4), FakeTokenizer())[0]
    body = OpenAITarget("http://127.0.0.1:9", "m").payload(request, spec)
    assert (body["top_p"], body["top_k"], body["min_p"]) == (0.9, 20, 0.05)
    plain = OpenAITarget("http://127.0.0.1:9", "m").payload(request, WorkloadSpec())
    assert not {"top_p", "top_k", "min_p"} & set(plain)  # defaults are not sent

    submitted = []

    class FakeService:
        model_name = "fake"

        def submit(self, prompt, params):
            submitted.append(params)
            raise ValueError("stop here")

    result = asyncio.run(EngineTarget(FakeService()).send(request, spec))
    assert result.error and submitted[0].top_k == 20 and submitted[0].min_p == 0.05
    for bad in ({"top_p": 0.0}, {"top_k": 0}, {"min_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WorkloadSpec(**bad)
