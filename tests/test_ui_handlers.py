"""Playground UI: figure and handler functions (with synthetic snapshots and with a small real
engine), then the app launched in-process and driven through gradio_client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
import time
from types import SimpleNamespace

import pytest

from engine import EngineConfig, SamplingParams
from engine.core.block_manager import BlockSnapshot
from engine.telemetry.ceilings import PRESETS
from engine.telemetry.stats import RequestProgress, StepStats
from playground.figures.blocks import MAX_CELLS, block_map_figure, build_cells, usage_gauge
from playground.figures.engine import batch_timeline_figure, queue_html
from playground.figures.latency import cdf_figure, gantt_figure, throughput_figure
from playground.figures.roofline import roofline_figure
from playground.handlers.chat import (
    ActiveRequests,
    ChatSessions,
    StreamThrottle,
    build_messages,
    render,
    sampling_params,
    stats_line,
)
from playground.handlers.chat_engine import stream_reply
from playground.handlers.compare import SideOutcome, compare_rows
from playground.handlers.compare_engine import engine_sides, preset_sides, side_config
from playground.handlers.kv import (
    CUSTOM_MODEL,
    DEFAULT_CUSTOM,
    LOADED_MODEL,
    MODEL_PRESETS,
    TABLE_CORNER,
    engine_pool_markdown,
    formula_markdown,
    parse_inputs,
    table_rows,
    variant_kv_heads,
)
from playground.handlers.latency import latency_view
from playground.handlers.live import live_view
from playground.handlers.loadtest import (
    WORKLOAD_FIELDS,
    BackgroundRun,
    spec_from_form,
    summary_rows,
)
from playground.handlers.roofline import caption
from playground.loadgen import EngineTarget, LoadTestResult, RequestResult, WorkloadSpec

# gradio's queue trips pandas 3 deprecations of its own; not ours to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

SMALL_ENGINE = {"model": "smollm2-135m", "dtype": "bfloat16", "num_kv_blocks": 256,
                "max_model_len": 1024}  # fmt: skip


def _snapshot(states, owners, filled, refs, block_size=16, layout="paged") -> BlockSnapshot:
    return BlockSnapshot(len(states), block_size, layout, states, owners, filled, refs)


def _step(i: int, kind: str = "decode", batch: int = 4, start: float = 0.0) -> StepStats:
    prefill = 64 if kind in ("prefill", "mixed") else 0
    decode = batch if kind in ("decode", "mixed") else 0
    return StepStats(
        step_index=i,
        start_time=start + 0.05 * i,
        duration_s=0.01,
        kind=kind,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_prefill_reqs=1 if prefill else 0,
        num_decode_reqs=decode,
        batch_size=batch,
        num_running=batch,
        num_waiting=0,
        num_preemptions=0,
        num_blocks_used=8,
        num_blocks_free=56,
        num_kv_blocks=64,
        flops=1e9 * batch,
        bytes_moved=3e8,
    )


def _result(index: int, t0: float, ok: bool = True) -> RequestResult:
    r = RequestResult(index, send_time=t0 + 0.1 * index, queue_s=0.02, prompt_tokens=16)
    if ok:
        r.first_token_time = r.send_time + 0.2
        r.token_times = [r.first_token_time + 0.05 * k for k in range(5)]
        r.end_time = r.token_times[-1]
        r.output_tokens = 5
        r.finish_reason = "length"
    else:
        r.end_time = r.send_time + 0.01
        r.error = "rejected: too long"
    return r


# --- figures, synthetic data ------------------------------------------------------------------


def test_block_map_colors_owners_and_hover_names_block_request_tokens_refs():
    snap = _snapshot(
        ["used", "used", "reserved", "free", "used"],
        ["req-1", "req-1", "req-1", None, "req-2"],
        [16, 5, 0, 0, 16],
        [1, 1, 1, 0, 2],
        layout="contiguous",
    )
    fig = block_map_figure(snap)
    heat = fig.data[0]
    assert "4 / 5 blocks held" in fig.layout.title.text
    assert "block 1<br>state: used<br>request: req-1<br>tokens filled: 5 / 16" in heat.text[0][1]
    assert "ref count: 2" in heat.text[0][4]
    names = {t.name for t in fig.data[1:]}
    assert {"free", "req-1", "req-1 (reserved, empty)", "req-2", "shared (ref count > 1)"} <= names
    # Same owner, same color for used cells; the reserved one is a different (lighter) color.
    z = heat.z[0]
    assert z[0] == z[1] != z[2] and z[3] != z[0]


def test_block_map_aggregates_huge_pools():
    n = MAX_CELLS * 3 + 1
    snap = _snapshot(["free"] * n, [None] * n, [0] * n, [0] * n)
    cells, per_cell = build_cells(snap)
    assert per_cell == 4 and len(cells) == math.ceil(n / 4)
    assert "one cell = 4 blocks" in block_map_figure(snap).layout.title.text


def test_block_map_of_a_gpu_sized_pool_is_one_small_heatmap_with_a_bounded_legend():
    # 100k blocks, 40 requests holding 30 blocks each, some prefix-cached and shared blocks.
    n = 100_000
    states, owners, refs = ["free"] * n, [None] * n, [0] * n
    for r in range(40):
        for b in range(r * 2500, r * 2500 + 30):
            states[b], owners[b], refs[b] = "used", f"req-{r}", 1
    for b in range(5000, 5010):
        refs[b] = 2
    for b in range(99_000, 99_500):
        states[b] = "cached"
    fig = block_map_figure(_snapshot(states, owners, [16] * n, refs))
    assert [t.type for t in fig.data].count("heatmap") == 1
    assert all(t.type == "heatmap" or list(t.x) == [None] for t in fig.data)  # legend only
    assert fig.data[0].z.size <= MAX_CELLS and "one cell = 49 blocks" in fig.layout.title.text
    assert len(fig.to_json()) < 400_000  # sent every second: stays small
    assert fig.layout.height <= 420  # compact, however big the pool
    legend = [t for t in fig.data[1:]]
    names = [t.name for t in legend]
    assert {"free", "free, prefix-cached", "shared (ref count > 1)"} <= set(names)
    owners_shown = [t for t in legend if t.name.startswith("req-")]
    assert (
        0 < len(owners_shown) <= 12
        and names[-1] == f"+{40 - len(owners_shown)} more requests (hover a cell)"
    )
    colors = [t.marker.color for t in legend if t.marker.color != "rgba(0,0,0,0)"]
    assert len(colors) == len(set(colors))  # no color twice in the legend
    # State colors never equal a request color.
    from playground.figures.style import CACHED_COLOR, FREE_COLOR, OWNER_PALETTE, SHARED_COLOR

    assert not {FREE_COLOR, CACHED_COLOR, SHARED_COLOR} & set(OWNER_PALETTE)


def test_gauge_and_queue_table():
    assert usage_gauge(64, 256).data[0].value == pytest.approx(25.0)
    rows = [
        RequestProgress("req-<b>", "running", 40, 40, 10, 20, 4),
        RequestProgress("req-9", "waiting", 30, 0, 0, 16, 0),
    ]
    html = queue_html(rows)
    assert "req-&lt;b&gt;" in html and "<b>1</b> running" in html and "10 / 20" in html
    assert "send a message" in queue_html([]).lower()


def test_timeline_cdf_gantt_and_throughput_figures():
    steps = [_step(0, "prefill", 1), *(_step(i, "decode", 3) for i in range(1, 6))]
    fig = batch_timeline_figure(steps, window_s=2.0)  # bins of 1/60 s: a bar per step
    assert list(fig.data[0].y) == [64, 0, 0, 0, 0, 0] and list(fig.data[1].y)[1] == 3
    assert fig.layout.yaxis.title.text == "tokens in the step" and fig.data[0].customdata[0] == (
        "step 0"
    )
    assert fig.layout.title.text.endswith("(6 steps)")
    assert batch_timeline_figure(steps[:1]).layout.title.text.endswith("(1 step)")
    assert "send a message" in batch_timeline_figure([]).layout.annotations[0].text.lower()
    cdf = cdf_figure({"TTFT": {"x": [3.0, 1.0, 2.0]}})
    assert list(cdf.data[0].x) == [1.0, 1.0, 2.0, 3.0] and cdf.data[0].y[-1] == 1.0
    t0 = 100.0
    results = [_result(0, t0), _result(1, t0), _result(2, t0, ok=False)]
    gantt = gantt_figure(results, t0)
    assert {t.name for t in gantt.data} == {"queue", "prefill", "decode", "failed"}
    tput = throughput_figure(steps, 0.0, bin_s=1.0)
    assert sum(tput.data[0].y) == 64 and sum(tput.data[1].y) == 15


def test_roofline_points_by_kind_with_fraction_of_roof():
    ceilings = PRESETS["H100 SXM"]
    steps = [_step(0, "prefill", 1), _step(1, "decode", 1), _step(2, "decode", 32)]
    fig = roofline_figure(ceilings, "bfloat16", steps)
    names = [t.name for t in fig.data]
    assert names[0].startswith("roof") and "prefill steps" in names and "decode steps" in names
    decode = next(t for t in fig.data if t.name == "decode steps")
    assert decode.marker.size[1] > decode.marker.size[0]  # bigger batch, bigger point
    assert "of the roof" in decode.text[0] and "FLOPs" in decode.text[0]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    text = caption(ceilings, "bfloat16", steps, "cpu")
    assert "1 prefill step (median" in text and "2 decode steps (median" in text


# --- pure handlers ----------------------------------------------------------------------------


def test_kv_formula_presets_and_variants():
    llama2 = MODEL_PRESETS["Llama-2-7B (MHA)"]
    assert variant_kv_heads(llama2, "as the model") == 32
    assert variant_kv_heads(llama2, "GQA") == 8 and variant_kv_heads(llama2, "MQA") == 1
    x = parse_inputs("Llama-2-7B (MHA)", "as the model", 4096, 1, "bf16 / fp16 (2 B)",
                     "bf16 / fp16 (2 B)", "A100 80GB", 0.9, None)  # fmt: skip
    assert x.kv() == 2 * 32 * 32 * 128 * 4096 * 2 == 2 << 30  # the classic 2 GiB per request
    md = formula_markdown(x)
    assert "2 x 32 x 32 (MHA" in md and "2,147,483,648" in md
    # (80e9 * 0.9 - 13.48e9 of weights) / 2 GiB per request
    assert x.max_requests() == int((80e9 * 0.9 - 6.74e9 * 2) // (2 << 30))
    headers, rows = table_rows(x)
    assert headers[1] == "512" and rows[0][0] == "1" and rows[-1][-1].endswith("✗")
    with pytest.raises(ValueError, match="batch size"):
        parse_inputs("Llama-2-7B (MHA)", "MHA", 4096, 0, "bf16 / fp16 (2 B)",
                     "bf16 / fp16 (2 B)", "A100 80GB", 0.9, None)  # fmt: skip
    with pytest.raises(ValueError, match="no engine"):
        parse_inputs(LOADED_MODEL, "MHA", 1, 1, "bf16 / fp16 (2 B)", "bf16 / fp16 (2 B)",
                     "A100 80GB", 0.9, None)  # fmt: skip


def test_workload_form_to_spec_and_readable_errors():
    spec = spec_from_form({"num_prompts": 8, "arrival": "all at once", "input_kind": "fixed",
                           "input_mean": 16, "output_kind": "fixed", "output_mean": 4})  # fmt: skip
    assert spec.num_prompts == 8 and math.isinf(spec.request_rate)
    assert spec.input_len.mean == 16 and spec.max_concurrency is None
    poisson = spec_from_form({"arrival": "Poisson", "request_rate": 4.0, "burstiness": 0.2})
    assert poisson.request_rate == 4.0 and poisson.burstiness == 1.0
    gamma = spec_from_form({"arrival": "gamma (bursty)", "burstiness": 0.25})
    assert gamma.burstiness == 0.25
    for bad, match in (
        ({"num_prompts": 0}, "number of requests"),
        ({"num_prompts": 2.5}, "number of requests"),
        ({"arrival": "Poisson", "request_rate": 0}, "request rate"),
        ({"input_kind": "uniform", "input_low": 50, "input_high": 10}, "min 50 > max 10"),
        ({"output_kind": "normal", "output_std": 0}, "output std"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top-p"),
        ({"top_k": 0}, "top-k"),
        ({"top_k": 2.5}, "top-k"),
    ):
        with pytest.raises(ValueError, match=match):
            spec_from_form(bad)
    with pytest.raises(ValueError, match="max_model_len 100"):
        spec_from_form({}, max_model_len=100)
    spec = spec_from_form({"temperature": 0.8, "top_p": 0.9, "top_k": 20})
    assert (spec.temperature, spec.top_p, spec.top_k) == (0.8, 0.9, 20)


def test_batch_timeline_in_seconds_ago_over_a_window_with_whole_request_ticks():
    old = [_step(i, "decode", 2, start=0.0) for i in range(5)]  # ~10 min before the rest
    busy = [_step(i, "decode", 3, start=600.0) for i in range(5, 400)]  # 395 steps, ~20 s
    now_s = busy[-1].start_time + 1.0
    fig = batch_timeline_figure(old + busy, now_s, window_s=120.0)
    assert fig.layout.xaxis.title.text == "seconds ago" and list(fig.layout.xaxis.range) == [
        -120,
        0,
    ]
    assert all(-120 <= x < 0 for x in fig.data[0].x)  # the old steps are out of the window
    assert len(fig.data[0].x) <= 120  # binned: the payload does not grow with the step rate
    assert sum(fig.data[1].y) == 3 * 395 and max(fig.data[2].y) == 3
    assert fig.layout.yaxis2.dtick == 1 and fig.layout.yaxis2.tickformat == "d"
    idle = batch_timeline_figure(old, now_s, window_s=30.0)
    assert "idle" in idle.layout.annotations[0].text


def test_batch_timeline_bars_are_a_bin_wide_so_a_chat_shows_on_a_long_window():
    """A chat's ~26 ms steps on the default 2-minute axis: one bar per step was a fifth of a
    pixel wide and the chart looked empty. Steps sharing a bin are summed, and every bar is
    drawn a bin wide (a lone bar too, which plotly would draw at its own default width)."""
    chat = [
        dataclasses.replace(_step(i, "decode", 1), start_time=0.026 * i) for i in range(80)
    ]  # ~2.1 s of steps
    fig = batch_timeline_figure(chat, chat[-1].start_time, window_s=120.0)
    bars = [t for t in fig.data if t.type == "bar"]
    assert {t.width for t in bars} == {0.9}  # 0.9 of the 1-second bin
    assert len(bars[1].x) == 3 and sum(bars[1].y) == 80
    assert fig.layout.yaxis.title.text == "tokens per 1 s" and bars[1].customdata[-1].endswith(
        "steps"
    )
    lone = batch_timeline_figure(chat[:1], chat[0].start_time + 5.0, window_s=30.0)
    assert lone.data[0].width == pytest.approx(0.9 * 30.0 / 120)
    edge = batch_timeline_figure(chat[:1], chat[0].start_time + 120.0, window_s=120.0)
    assert -120 < edge.data[0].x[0] < 0  # a step at the window's very edge stays on the axis


def test_chat_helpers():
    p = sampling_params(0.7, 0.9, -1, 32, -1)
    assert p.top_k == -1 and p.seed is None and p.max_tokens == 32
    assert sampling_params(0.0, 1.0, 5, 8, 42).seed == 42
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_params(0.7, 0.9, -1, 2.5, 1)
    with pytest.raises(ValueError, match="top_p"):
        sampling_params(0.7, 0.0, -1, 8, 1)
    msgs = build_messages("Be brief.", [{"role": "user", "content": "hi"}], "again")
    assert [m["role"] for m in msgs] == ["system", "user", "user"]
    shown = render([{"role": "assistant", "content": "yo", "stats": "TTFT 5 ms"}], "par", "live")
    assert shown[0]["content"].endswith("<sub>TTFT 5 ms</sub>") and "par ▌" in shown[1]["content"]


def test_chat_fields_use_the_engines_off_convention_and_never_round():
    # -1 = off for top-k, as in Load test and SamplingParams; 0, fractions and seeds < -1 are
    # refused with the field's name, never rounded or accepted.
    for top_k, seed, field in ((0, 1, "top_k"), (2.5, 1, "top_k"), (-2, 1, "top_k"),
                               (None, 1, "top_k"), (-1, -5, "seed"), (-1, 0.5, "seed"),
                               (-1, float("nan"), "seed")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            sampling_params(0.7, 0.9, top_k, 8, seed)
    assert sampling_params(0.7, 0.9, 3.0, 8, 0.0).top_k == 3
    assert sampling_params(0.7, 0.9, -1, 8, 0).seed == 0


def test_chat_penalties_reach_sampling_params_and_bad_ones_are_named():
    p = sampling_params(0.7, 0.9, -1, 8, -1, 1, 0.5, -0.25, 1.2)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
    assert not sampling_params(0.7, 0.9, -1, 8, -1).changes_logits  # the form's defaults: off
    for penalties, field in (((3.0, 0, 1), "frequency_penalty"), ((0, None, 1), "presence"),
                             ((0, 0, 0.0), "repetition_penalty")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            sampling_params(0.7, 0.9, -1, 8, -1, 1, *penalties)


def test_chat_sessions_one_reply_at_a_time_and_clear_makes_the_reply_stale():
    sessions = ChatSessions()
    first = sessions.begin("s1")
    assert first is not None and sessions.streaming("s1")
    assert sessions.begin("s1") is None  # a second send while streaming is refused
    assert sessions.begin("s2") is not None  # another browser tab chats at the same time
    sessions.reset("s1")  # Clear during the stream
    assert not sessions.current("s1", first) and not sessions.streaming("s1")
    second = sessions.begin("s1")  # the new conversation may send at once
    assert second is not None and sessions.current("s1", second)
    sessions.end("s1", first)  # the stale reply ending does not end the new one
    assert sessions.streaming("s1")
    sessions.end("s1", second)
    assert not sessions.streaming("s1")


def test_one_stats_line_for_engine_and_client_metrics():
    from playground.remote.client import ClientMetrics

    engine = SimpleNamespace(ttft_s=0.02, tpot_s=0.005, e2e_s=0.5)
    line = stats_line(engine, 10, "length")
    assert line == "TTFT 20 ms · TPOT 5 ms · 20.0 tok/s · 10 tokens · hit max tokens"
    counted = ClientMetrics(ttft_s=0.1, e2e_s=1.0, num_tokens=4, tokens_from_usage=False)
    line = stats_line(counted, 4, "abort", chunks_counted=True, measured_by="by the client")
    assert line == (
        "TTFT 100 ms · TPOT 300 ms · 4.0 tok/s · ≥4 tokens (chunks counted) · by the client"
        " · stopped"
    )
    assert stats_line(SimpleNamespace(ttft_s=None, tpot_s=None, e2e_s=None), 0, None) == "0 tokens"
    # Beside TTFT the prompt (and the prefix cache's share), beside TPOT the accepted drafts.
    line = stats_line(engine, 10, "stop", prompt_tokens=245, cached_tokens=224, accepted_drafts=4)
    assert line == (
        "TTFT 20 ms (prompt 245 tokens, 224 cached) · TPOT 5 ms (4 of 10 tokens from accepted "
        "drafts) · 20.0 tok/s · 10 tokens"
    )
    assert stats_line(engine, 10, None, prompt_tokens=9).startswith("TTFT 20 ms (prompt 9 tokens)")


def test_stream_throttle_lets_one_update_per_interval_and_always_the_last():
    throttle = StreamThrottle(interval_s=60.0)
    assert throttle.due(last=False)  # the first update shows at once
    assert not throttle.due(last=False)  # within the interval: skipped
    assert throttle.due(last=True)  # the finished reply is never skipped
    fast = StreamThrottle(interval_s=0.0)
    assert all(fast.due(last=False) for _ in range(3))


class _InstantTarget:
    """A load-test target that answers each request at once, one token."""

    name = "instant"

    async def send(self, request, spec):
        now = time.perf_counter()
        return RequestResult(request.index, now, now, now, [now], request.prompt_len, 1)

    async def aclose(self):
        pass


class _FakeSide:
    config = None
    starting = "starting"
    finishing = "finishing"

    def __init__(self, name, refuse=False):
        self.name, self.label, self.refuse = name, f"{name}: fake", refuse
        self.finished_with = None

    def start(self):
        if self.refuse:
            raise RuntimeError("refused")
        return _InstantTarget()

    def finish(self, outcome, run):
        self.finished_with = run
        outcome.steps = [_step(0, "decode", 2)]


def test_background_compare_runs_any_side_and_reports_one_that_refuses():
    from playground.handlers.compare import BackgroundCompare
    from playground.loadgen import GenRequest

    spec = WorkloadSpec(num_prompts=2, request_rate=math.inf)
    requests = [GenRequest(i, [5, 6], 2, 1) for i in range(2)]
    refusing, working = _FakeSide("A", refuse=True), _FakeSide("B")
    cmp = BackgroundCompare(spec, [refusing, working], requests).start()
    assert cmp.done.wait(30)
    a, b = cmp.outcomes
    assert a.error == "refused" and a.result is None and refusing.finished_with is None
    assert b.error is None and b.result.summary()["completed"] == 2
    assert working.finished_with is not None and len(b.steps) == 1  # finish() kept its steps
    assert "A: fake: refused" in cmp.problems()


def test_summary_rows_and_compare_rows():
    t0 = 10.0
    results = [_result(i, t0) for i in range(3)] + [_result(3, t0, ok=False)]
    result = LoadTestResult(WorkloadSpec(num_prompts=4), "engine:x", t0, t0 + 2.0, results)
    rows = dict((r[0], r[1]) for r in summary_rows(result.summary()))
    assert rows["Successful requests"] == "3" and rows["Failed requests"] == "1"
    assert float(rows["Mean TTFT (ms)"]) == pytest.approx(200.0)
    assert float(rows["Mean TPOT (ms)"]) == pytest.approx(50.0)
    assert "Failed x1" in rows
    cfg = EngineConfig(**SMALL_ENGINE)
    a, b = SideOutcome("A", "A: x", cfg, result), SideOutcome("B", "B: y", cfg, result)
    b.steps = [_step(0, "decode", 4)]
    table = {r[0]: r for r in compare_rows(a, b)}
    assert table["Mean TTFT (ms)"][3] == "x1.00" and table["Mean TTFT (ms)"][4] == ""
    assert table["Engine steps"][1:3] == ["0", "1"] and table["Engine steps"][4] == "A"


def test_compare_side_configs_hold_the_kv_budget_in_tokens():
    base = EngineConfig(**SMALL_ENGINE)
    a, b = preset_sides("block size 64 vs 16")
    assert side_config(base, a, 4096, 512, head_dim=64).num_kv_blocks == 64
    assert side_config(base, b, 4096, 512, head_dim=64).num_kv_blocks == 256
    static, continuous = preset_sides("static vs continuous batching")
    assert side_config(base, static, 4096, 512, head_dim=64).batching == "static"
    contiguous, _ = preset_sides("contiguous vs paged KV")
    with pytest.raises(ValueError, match="reserves max_model_len"):
        side_config(base, contiguous, 256, 512, head_dim=64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        side_config(base, {**continuous, "max_num_seqs": 0}, 4096, 512, head_dim=64)
    off, on = preset_sides("prefix caching off vs on (shared prompt prefix)")
    assert side_config(base, on, 4096, 512, head_dim=64).enable_prefix_caching
    assert not side_config(base, off, 4096, 512, head_dim=64).enable_prefix_caching
    with pytest.raises(ValueError, match="paged KV layout"):
        side_config(base, {**on, "kv_layout": "contiguous"}, 4096, 512, head_dim=64)
    plain, ngram = preset_sides("speculative decoding off vs n-gram")
    assert side_config(base, ngram, 4096, 512, head_dim=64).speculative_method == "ngram"
    assert side_config(base, plain, 4096, 512, head_dim=64).speculative_method == "off"


# --- handlers with a real engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def service():
    from engine.serving.service import EngineService

    svc = EngineService(EngineConfig(**SMALL_ENGINE))
    yield svc
    svc.shutdown()


def _wait_idle(service, timeout_s: float = 30.0) -> None:
    from engine.serving.service import wait_until_idle

    assert wait_until_idle(service, timeout_s)


def test_stream_reply_metrics_and_live_view_block_ownership(service):
    async def chat():
        active = ActiveRequests()
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outs, views = [], []
        async for out in stream_reply(service, "Count to ten:", params, active, "s1"):
            outs.append(out)
            if not out.finished and not views:
                assert active.get("s1") == out.request_id
                views.append(await asyncio.to_thread(live_view, service))
        return outs, views, active

    outs, views, active = asyncio.run(chat())
    last = outs[-1]
    assert last.finished and len(last.token_ids) == 24 and active.get("s1") is None
    line = stats_line(last.metrics, len(last.token_ids), last.finish_reason)
    assert "TTFT" in line and "TPOT" in line and "24 tokens" in line and "tok/s" in line
    _, view = views[0]
    owned = [t.name for t in view.block_map.data[1:]]
    assert last.request_id in owned  # the streaming request holds blocks
    _wait_idle(service)
    sig, after = live_view(service)
    assert "KV blocks used: 0 / 256" in after.summary_md
    _, again = live_view(service, last_signature=sig)  # nothing changed: nothing rebuilt
    assert again.block_map is None and again.summary_md is None
    assert last.request_id not in [t.name for t in after.block_map.data[1:]]
    lat = latency_view(service.stats(), "all kept")
    assert lat.table[0][0] == "TTFT" and lat.table[0][1] >= 1


def test_background_load_test_and_stop(service):
    spec = spec_from_form({"num_prompts": 4, "arrival": "all at once", "input_kind": "fixed",
                           "input_mean": 16, "output_kind": "fixed", "output_mean": 4})  # fmt: skip
    run = BackgroundRun(spec, EngineTarget(service)).start()
    assert run.done.wait(60)
    assert run.error is None and not run.stopped
    summary = run.result.summary()
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 16
    json.loads(run.result.to_json())
    # Stopped mid-run: requests in flight are aborted, the engine ends up idle.
    long = spec.replace(num_prompts=6, output_len=spec.output_len.fixed(200))
    run = BackgroundRun(long, EngineTarget(service)).start()
    time.sleep(1.0)
    run.stop()
    assert run.done.wait(30) and run.stopped and run.result is not None
    _wait_idle(service)
    assert service.stats().num_free_kv_blocks == 256


def test_engine_pool_matches_the_formula(service):
    from playground.engine_info import engine_info

    md = engine_pool_markdown(engine_info(service), 512)
    assert "which matches the allocation" in md
    assert "Requests of 512 tokens that fit at once: **8**" in md  # 256 x 16 / 512
    info = engine_info(service)
    too_long = engine_pool_markdown(info, info.max_model_len + 1)
    assert (
        f"fit at once: **0** (longer than this engine's max_model_len of {info.max_model_len:,}"
        in (too_long)
    )


def test_kv_calculator_clears_its_outputs_on_a_form_error_and_fits_the_context(service):
    """Picking the loaded model (max_model_len 1,024) while the context field held Llama-3-8B's
    4,096 tokens left the Llama chart and table beside the error; now the field moves down to
    the model's maximum, and a form error clears every output."""
    from playground.engine_info import engine_info
    from playground.handlers.kv_view import calculator_view, context_for_model

    info = engine_info(service)
    form = ("Llama-3-8B (GQA)", "as the model", 4096, 32, "bf16 / fp16 (2 B)",
            "bf16 / fp16 (2 B)", "H100 SXM 80GB", 0.9)  # fmt: skip
    view = calculator_view(form, DEFAULT_CUSTOM, info, None)
    assert view.formula.startswith("#### Llama-3-8B") and len(view.bars.data) > 0
    assert view.headers[0] == TABLE_CORNER and len(view.rows) == 7
    assert "Pick **the loaded model**" in view.engine
    bad = calculator_view((LOADED_MODEL, *form[1:]), DEFAULT_CUSTOM, info, None)
    assert bad.formula.startswith("**Check the form:** context length: 4,096 tokens")
    assert not bad.bars.data and "Check the form" in bad.bars.layout.annotations[0].text
    assert bad.rows == [] and bad.headers == [TABLE_CORNER] and bad.engine == ""
    assert context_for_model(LOADED_MODEL, 4096, info, DEFAULT_CUSTOM) == info.max_model_len
    assert context_for_model(LOADED_MODEL, 512, info, DEFAULT_CUSTOM) is None
    assert context_for_model("Llama-3-8B (GQA)", 10**6, info, DEFAULT_CUSTOM) == 8192
    assert context_for_model(CUSTOM_MODEL, 10**6, info, DEFAULT_CUSTOM) is None  # no limit
    assert context_for_model(LOADED_MODEL, None, info, DEFAULT_CUSTOM) is None  # the form says
    fitted = calculator_view((LOADED_MODEL, form[1], info.max_model_len, *form[3:]),
                             DEFAULT_CUSTOM, info, None)  # fmt: skip
    assert "which matches the allocation" in fitted.engine


def test_header_says_where_the_weights_come_from_and_their_precision(service):
    from playground.engine_info import describe, engine_info, weights_text

    header = describe(engine_info(service))
    assert "smollm2-135m**, weights: Q4_1 GGUF" in header and "dequantized to bfloat16" in header
    assert "random bfloat16" in weights_text("random:llama-3-8b", "bfloat16")
    assert "GGUF file m.gguf dequantized to float32" in weights_text("/x/m.gguf", "float32")


# --- the app through gradio_client ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(service):
    from gradio_client import Client

    from playground.app import build_app, launch

    demo = build_app(service)
    port = _free_port()
    launch(demo, port=port, block=False)
    yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()


def test_api_chat_streams_a_reply_with_metrics(client):
    chatbot, message, status = client.predict(
        "Say hello.", "Be brief.", 0.0, 1.0, -1, 8, 1, api_name="/chat"
    )
    reply = chatbot[-1]["content"][0]["text"]
    assert chatbot[-1]["role"] == "assistant" and "TTFT" in reply and "8 tokens" in reply
    assert message == "" and status == ""


def test_api_chat_stop_aborts_and_frees_blocks(client, service):
    job = client.submit("Write a long story.", "", 0.0, 1.0, -1, 400, 1, api_name="/chat")
    deadline = time.monotonic() + 30
    while service.stats().num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert "Stopped req-" in client.predict(api_name="/stop_chat")
    chatbot, _, _ = job.result(timeout=30)
    assert "stopped" in chatbot[-1]["content"][0]["text"]
    _wait_idle(service)
    assert service.stats().num_free_kv_blocks == 256


def _load_test_form(**changes) -> list:
    """The /load_test endpoint's arguments: a small fixed workload, `changes` applied."""
    form = dict(num_prompts=4, max_concurrency=0, seed=0, arrival="all at once",
                request_rate=1, burstiness=1, input_kind="fixed", input_mean=8, input_low=1,
                input_high=8, input_std=1, output_kind="fixed", output_mean=4, output_low=1,
                output_high=4, output_std=1, prefix_len=0, temperature=0, top_p=1, top_k=-1,
                ignore_eos=True, n=1)  # fmt: skip
    form |= changes
    return [form[k] for k in WORKLOAD_FIELDS]


def test_api_chat_penalties_change_a_greedy_reply(client, service):
    """The Chat tab's penalty sliders reach the engine: each turns a greedy reply into another
    (at the defaults, the reply the plain call gives)."""
    from gradio_client import Client

    def reply(*penalties) -> str:
        fresh = Client(client.src, verbose=False)  # a new session: no earlier turns
        form = ("List the days of the week, twice.", "", 0.0, 1.0, -1, 24, -1, 1, *penalties)
        chatbot, _, status = fresh.predict(*form, api_name="/chat")
        assert status == "", status
        return chatbot[-1]["content"][0]["text"].split("\n\n<sub>")[0]

    plain = reply()
    assert reply(0.0, 0.0, 1.0) == plain
    for penalties in ((1.5, 0.0, 1.0), (0.0, 2.0, 1.0), (0.0, 0.0, 1.5)):
        assert reply(*penalties) != plain, penalties
    _wait_idle(service)


def test_api_chat_token_probabilities(client):
    """The Chat tab's token view through /chat: shaded token spans and the reply's perplexity."""
    from gradio_client import Client

    fresh = Client(client.src, verbose=False)
    form = ("Say hello.", "", 0.0, 1.0, -1, 6, -1, 1, 0.0, 0.0, 1.0, True)
    chatbot, _, status = fresh.predict(*form, api_name="/chat")
    reply = chatbot[-1]["content"][0]["text"]
    assert status == "" and reply.startswith('<div class="pg-tokens">')
    assert reply.count('class="pg-tok"') == 6 and "perplexity" in reply


def test_api_bad_values_give_messages_not_tracebacks(client):
    from gradio_client.exceptions import AppError

    _, _, status = client.predict("hi", "", 0.7, 0.9, -1, 2.5, 1, api_name="/chat")
    assert "Not sent" in status and "max_tokens" in status
    # A value no form sends (a string for a slider) is named, not hidden behind Gradio's
    # "the upstream app has raised an exception" (show_error).
    with pytest.raises(AppError, match="Expected a `float`"):
        client.predict("hi", "", "abc", 0.9, -1, 8, 1, api_name="/chat")
    out = client.predict(*_load_test_form(num_prompts=0), api_name="/load_test")
    assert "Not started" in out[1] and "number of requests" in out[1]


def test_forms_that_cannot_run_are_refused_before_any_engine_starts(client, service):
    """A KV budget beyond the machine's memory and an n above max_num_seqs: 'Not started' with
    the reason, where a Compare side used to fail with the allocator's message and a load test
    to report every request failed."""
    from playground.handlers.compare_checks import (
        available_memory_bytes,
        check_kv_budget,
        check_samples_fit,
    )

    memory = available_memory_bytes("cpu")
    assert memory is not None and memory > 1 << 20
    check_kv_budget(4096, 23_040, memory)  # SmolLM2's 4,096 tokens: 94 MB, fits
    with pytest.raises(ValueError, match=r"KV budget: 10 tokens are 1000 B of K/V \(100 B a"):
        check_kv_budget(10, 100, 999)
    check_kv_budget(10**15, 100, None)  # unknown memory: the engine decides
    with pytest.raises(ValueError, match="n \\(samples per prompt\\): 5 is more than side B's"):
        check_samples_fit(5, {"side A": 8, "side B": 4})
    endpoint = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    defaults = [p.get("parameter_default") for p in endpoint["/compare"]["parameters"]]
    defaults[1] = 10**12  # KV budget, tokens
    status = client.predict(*defaults, api_name="/compare")[1]
    assert status.startswith("**Not started:** KV budget: 1,000,000,000,000 tokens are"), status
    form = _load_test_form(num_prompts=2, output_mean=2, temperature=1, n=65)
    out = client.predict(*form, api_name="/load_test")
    assert "Not started" in out[1] and "the engine's max_num_seqs of 64" in out[1]
    assert service.stats().num_running == 0


def test_api_load_test_live_and_kv_tabs(client):
    form = _load_test_form(max_concurrency=2, arrival="Poisson", request_rate=20,
                           input_kind="uniform", input_low=8, input_high=24, prefix_len=8)  # fmt: skip
    out = client.predict(*form, api_name="/load_test")
    progress, status, _, _, _, table, download = out
    rows = {r[0]: r[1] for r in table["data"]}
    assert rows["Successful requests"] == "4" and float(rows["Output token throughput (tok/s)"]) > 0
    assert "Done" in status and "4 / 4 requests done" in progress
    assert download["visible"] is True  # an update: the button appears with the file
    with open(download["value"], encoding="utf-8") as f:
        data = json.load(f)
    assert data["summary"]["completed"] == 4 and len(data["per_request"]) == 4
    summary = client.predict(api_name="/live_refresh")[0]
    assert "KV blocks used" in summary
    md = client.predict(api_name="/latency")[0]
    assert "finished requests" in md
    kv = client.predict(api_name="/kv_calc")
    assert "17,179,869,184" in kv[0]  # Llama-3-8B, 4096 tokens, batch 32, bf16
    _, caption = client.predict("H100 SXM", api_name="/roofline")
    assert "decode steps" in caption and "memory-bound" in caption


def test_background_compare_runs_both_sides_and_keeps_peak_maps(service):
    from engine.serving.service import EngineService
    from playground.handlers.compare import BackgroundCompare
    from playground.handlers.compare_engine import side_label
    from playground.loadgen import build_requests

    spec = spec_from_form({"num_prompts": 3, "arrival": "all at once", "input_kind": "fixed",
                           "input_mean": 16, "output_kind": "fixed", "output_mean": 3})  # fmt: skip
    static, continuous = preset_sides("static vs continuous batching")
    sides = [
        (
            "A",
            side_label("A", static, continuous),
            side_config(service.config, static, 1024, 256, head_dim=64),
        ),
        (
            "B",
            side_label("B", continuous, static),
            side_config(service.config, continuous, 1024, 256, head_dim=64),
        ),
    ]
    requests = build_requests(spec, service.tokenizer)
    cmp = BackgroundCompare(spec, engine_sides(sides, EngineService), requests).start()
    assert cmp.done.wait(120)
    a, b = cmp.outcomes
    assert a.label == "A: batching=static" and a.config.batching == "static"
    for side in (a, b):
        assert side.error is None and side.result.summary()["completed"] == 3
        assert side.peak is not None and side.peak.num_blocks == 64
        assert side.peak.num_blocks - side.peak.num_free >= 3  # three prompts held at once
    table = compare_rows(a, b)
    rows = {r[0]: r for r in table}
    assert rows["Successful requests"][1:3] == ["3", "3"]
    from playground.handlers.compare_export import write_compare_json

    with open(write_compare_json(spec, 1, cmp.outcomes, table), encoding="utf-8") as f:
        saved = json.load(f)  # the Compare tab's download
    assert [s["config"]["batching"] for s in saved["sides"]] == ["static", "continuous"]
    assert saved["sides"][0]["runs"][0]["summary"]["completed"] == 3
    assert saved["table"]["rows"] == table


def test_compare_prefix_caching_computes_only_the_uncached_prompt_tokens(service):
    """The preset's workload (a shared prefix) on both sides: B finds the prefix in its cache
    and computes fewer prompt tokens; the rows say so, with B as the better side."""
    from engine.serving.service import EngineService
    from playground.handlers.compare import BackgroundCompare
    from playground.handlers.compare_engine import PRESET_DEFAULTS, side_label
    from playground.loadgen import build_requests

    name = "prefix caching off vs on (shared prompt prefix)"
    spec = spec_from_form({"num_prompts": 4, "arrival": "all at once", "input_kind": "fixed",
                           "input_mean": 8, "output_kind": "fixed", "output_mean": 2,
                           "max_concurrency": 1,
                           "prefix_len": PRESET_DEFAULTS[name].workload["prefix_len"]})  # fmt: skip
    off, on = preset_sides(name)
    sides = [
        (n, side_label(n, side, other), side_config(service.config, side, 1024, 256, head_dim=64))
        for n, side, other in (("A", off, on), ("B", on, off))
    ]
    requests = build_requests(spec, service.tokenizer)
    cmp = BackgroundCompare(spec, engine_sides(sides, EngineService), requests)
    assert cmp.start().done.wait(120)
    a, b = cmp.outcomes
    assert a.error is None and b.error is None
    rows = {r[0]: r for r in compare_rows(a, b)}
    prompt_tokens = 4 * (192 + 8)
    assert rows["Prompt tokens computed (prefill)"][1] == str(prompt_tokens)
    assert rows["Prompt tokens from the prefix cache"][1] == "0"
    hits = int(rows["Prompt tokens from the prefix cache"][2])
    assert hits >= 3 * (192 // 16 - 1) * 16  # one at a time: requests 2-4 find the prefix
    assert rows["Prompt tokens computed (prefill)"][2] == str(prompt_tokens - hits)
    assert rows["Prompt tokens computed (prefill)"][4] == "B"


def test_api_two_sessions_chat_at_once_in_the_same_engine_steps(client, service):
    from gradio_client import Client

    sessions = [Client(client.src, verbose=False) for _ in range(2)]  # two fresh browser tabs
    first_step = service.stats().num_steps_total
    jobs = [
        c.submit(f"Write a long story about {topic}.", "", 0.0, 1.0, -1, 24, 1, api_name="/chat")
        for c, topic in zip(sessions, ("a dragon", "the sea"), strict=True)
    ]
    for job in jobs:
        assert "TPOT" in job.result(timeout=60)[0][-1]["content"][0]["text"]
    steps = [s for s in service.stats().steps if s.step_index >= first_step]
    assert max(s.num_decode_reqs for s in steps) == 2  # both replies decoded in one step


def test_api_chat_and_live_refresh_answer_during_a_load_test(client, service):
    args = dict(num_prompts=6, max_concurrency=0, seed=1, arrival="all at once",
                request_rate=1, burstiness=1, input_kind="fixed", input_mean=32, input_low=1,
                input_high=32, input_std=1, output_kind="fixed", output_mean=64, output_low=1,
                output_high=64, output_std=1, prefix_len=0, temperature=0, top_p=1, top_k=-1, ignore_eos=True, n=1)  # fmt: skip
    job = client.submit(*(args[k] for k in WORKLOAD_FIELDS), api_name="/load_test")
    deadline = time.monotonic() + 30
    while service.stats().num_running < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    summary = client.predict(api_name="/live_refresh")[0]
    assert time.monotonic() - t0 < 5 and "running **" in summary
    chatbot, _, _ = client.predict("Hi!", "", 0.0, 1.0, -1, 4, 1, api_name="/chat")
    assert "4 tokens" in chatbot[-1]["content"][0]["text"]
    assert not job.done()  # the chat reply came back while the load test was still running
    rows = {r[0]: r[1] for r in job.result(timeout=120)[5]["data"]}
    assert rows["Successful requests"] == "6"


def test_live_summary_reports_prefix_cache_hits_once_used():
    from engine.telemetry.stats import EngineStats
    from playground.handlers.live import summary_markdown

    base = dict(num_kv_blocks=64, num_free_kv_blocks=60, block_size=16, kv_cache_bytes=1 << 20,
                num_running=1, num_waiting=0, num_preemptions_total=0, num_steps_total=3)  # fmt: skip
    assert "prefix cache" not in summary_markdown(EngineStats(**base), 4)
    one = EngineStats(**base, steps=[dataclasses.replace(_step(0, "decode", 1), duration_s=0.026)])
    assert "last step: decode, 1 request, 1 token, 26.0 ms" in summary_markdown(one, 4)
    stats = EngineStats(**base, num_prefix_query_tokens_total=400, num_prefix_hit_tokens_total=300,
                        num_cached_kv_blocks=12, num_prefix_evictions_total=2)  # fmt: skip
    assert "prefix cache: 300 of 400 prompt tokens hit (75 %), 12 blocks cached, 2 evicted" in (
        summary_markdown(stats, 4)
    )
    assert "speculative" not in summary_markdown(stats, 4)
    stats = EngineStats(**base, num_draft_tokens_total=80, num_accepted_tokens_total=20)
    assert "speculative: 20 of 80 draft tokens accepted (25 %)" in summary_markdown(stats, 4)


def test_batch_timeline_marks_copy_on_write_steps():
    """Parallel sampling's block copies show as markers, per step and summed per time bin."""
    steps = [_step(i, "decode", 3) for i in range(6)]
    steps[2] = dataclasses.replace(steps[2], num_block_copies=2)
    fig = batch_timeline_figure(steps)
    cow = [t for t in fig.data if t.name == "copy-on-write"]
    assert len(cow) == 1 and list(cow[0].customdata) == [2] and len(cow[0].x) == 1
    assert not [t for t in batch_timeline_figure(steps[:2]).data if t.name == "copy-on-write"]
    many = [dataclasses.replace(_step(i, "decode", 3), num_block_copies=1) for i in range(300)]
    binned = batch_timeline_figure(many, many[-1].start_time + 0.1, window_s=120.0)
    cow = next(t for t in binned.data if t.name == "copy-on-write")
    assert sum(cow.customdata) == 300
