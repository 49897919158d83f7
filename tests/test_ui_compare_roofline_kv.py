"""Issue 12 (Compare, Roofline, Latency, KV calculator) at the handler level: what each tab
computes, without a browser (tests/test_browser_compare.py drives the same tabs in Chromium)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from engine import EngineConfig
from engine.core.block_manager import BlockSnapshot
from playground.handlers.compare import (
    COMPARE_HEADERS,
    HEADLINE_MARK,
    NOISE_FRACTION,
    BackgroundCompare,
    SideOutcome,
    compare_rows,
    winner,
)
from playground.handlers.compare_engine import (
    DEFAULT_COMPARE_WORKLOAD,
    PRESET_DEFAULTS,
    PRESETS,
    SIDE_FIELDS,
    preset_form,
)
from playground.handlers.loadtest import spec_from_form
from playground.loadgen import GenRequest, LoadTestResult, RequestResult, WorkloadSpec

SMALL = EngineConfig(model="smollm2-135m", dtype="bfloat16", num_kv_blocks=64, max_model_len=256)


def _result(ttft_s: float, n: int = 4, t0: float = 0.0, duration_s: float = 2.0):
    per_request = []
    for i in range(n):
        r = RequestResult(i, send_time=t0, first_token_time=t0 + ttft_s, prompt_tokens=8)
        r.token_times = [t0 + ttft_s + 0.1 * k for k in range(4)]
        r.end_time, r.output_tokens, r.finish_reason = r.token_times[-1], 4, "length"
        per_request.append(r)
    return LoadTestResult(WorkloadSpec(num_prompts=n), "engine:x", t0, t0 + duration_s, per_request)


def _outcome(name: str, ttfts: list[float]) -> SideOutcome:
    runs = [_result(t) for t in ttfts]
    return SideOutcome(name, f"{name}: x", SMALL, result=runs[-1], runs=runs)


# --- Compare ---------------------------------------------------------------------------------


def test_every_preset_sets_every_field_and_resets_the_others():
    prefix = "prefix caching off vs on (shared prompt prefix)"
    with_prefix = preset_form(prefix)
    assert with_prefix["workload"]["prefix_len"] == 192
    for name in PRESETS:
        form = preset_form(name)
        assert set(form["A"]) == set(form["B"]) == set(SIDE_FIELDS)
        assert set(DEFAULT_COMPARE_WORKLOAD) <= set(form["workload"])  # no field left unset
        assert PRESET_DEFAULTS[name].headline  # each preset names its headline row
        spec_from_form(form["workload"], form["max_model_len"])  # the defaults are valid
        if name != prefix:  # the 192-token prefix does not carry over to the next preset
            assert form["workload"]["prefix_len"] == 0
    static = preset_form("static vs continuous batching")["workload"]
    assert static["output_low"] == 2 and static["num_prompts"] == 16
    assert preset_form("contiguous vs paged KV")["workload"]["output_low"] == 4  # reset


def test_better_only_beyond_the_noise_band():
    assert winner(100.0, 101.5, "lower", NOISE_FRACTION) == "≈"  # 1.5%: noise
    assert winner(100.0, 80.0, "lower", NOISE_FRACTION) == "B"
    assert winner(100.0, 80.0, "higher", NOISE_FRACTION) == "A"
    assert winner(100.0, 80.0, "lower", 0.3) == "≈"  # a side's own spread is wider
    assert winner(3, 3, "lower", NOISE_FRACTION) == "" and winner(1, 2, None, 0.05) == ""
    # Repeats: A's TTFT spread over its runs (100 vs 160 ms, 46% of the median) is the band.
    a, b = _outcome("A", [0.10, 0.16]), _outcome("B", [0.09, 0.09])
    rows = {r[0]: r for r in compare_rows(a, b)}
    ttft = rows["Mean TTFT (ms)"]
    assert ttft[1] == "130.00" and ttft[2] == "90.00"  # medians of the repeats
    assert ttft[4] == "≈" and ttft[5] == "±46%"
    assert len(ttft) == len(COMPARE_HEADERS)
    steady = _outcome("A", [0.10, 0.10])
    assert {r[0]: r for r in compare_rows(steady, b)}["Mean TTFT (ms)"][4] == "B"


def test_the_headline_row_comes_first_and_is_marked():
    a, b = _outcome("A", [0.1]), _outcome("B", [0.1])
    for o, held in ((a, 256), (b, 31)):
        states = ["used"] * held + ["free"] * (256 - held)
        layout = "contiguous" if held == 256 else "paged"
        o.peak = BlockSnapshot(256, 16, layout, states, [None] * 256, [0] * 256, [0] * 256)
    headline = PRESET_DEFAULTS["contiguous vs paged KV"].headline
    rows = compare_rows(a, b, headline=headline)
    assert rows[0][0] == HEADLINE_MARK + "Peak KV blocks held"
    assert rows[0][1:5] == ["256", "31", "x0.12", "B"]  # the row that makes the point wins
    tokens = {r[0]: r for r in rows}["Peak KV tokens held (blocks x block size)"]
    assert tokens[1:3] == ["4096", "496"]


class _SlowTarget:
    """A load-test target that answers each request after 10 ms, one token."""

    name = "slow"

    async def send(self, request, spec):
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        return RequestResult(request.index, t, now, now, [now], request.prompt_len, 1)

    async def aclose(self):
        pass


class _Side:
    def __init__(self, name: str) -> None:
        self.name, self.label, self.config = name, f"{name}: fake", None
        self.starting, self.finishing = "starting", "finishing"

    def start(self):
        return _SlowTarget()

    def finish(self, outcome, run):
        pass


def test_compare_progress_covers_both_sides_and_repeats_and_never_goes_back():
    spec = WorkloadSpec(num_prompts=3, request_rate=math.inf)
    requests = [GenRequest(i, [5, 6], 2, 1) for i in range(3)]
    cmp = BackgroundCompare(spec, [_Side("A"), _Side("B")], requests, repeats=2)
    assert cmp.total_requests == 12
    assert "0 / 12 requests" in cmp.progress()
    assert "Running the compare" in cmp.running_status()
    seen = []
    cmp.start()
    while not cmp.done.wait(0.005):
        seen.append(int(cmp.progress().split(" / ")[0].rsplit(">", 1)[-1]))
    assert seen == sorted(seen)  # side B does not start the bar from 0 again
    a, b = cmp.outcomes
    assert len(a.runs) == len(b.runs) == 2
    assert "12 / 12 requests" in cmp.final_progress() and "2 runs" in cmp.final_progress()
    with pytest.raises(ValueError, match="repeats"):
        BackgroundCompare(spec, [_Side("A")], requests, repeats=0)
