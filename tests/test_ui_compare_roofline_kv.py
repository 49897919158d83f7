"""Issue 12 (Compare, Roofline, Latency, KV calculator) at the handler level: what each tab
computes, without a browser (tests/test_browser_compare.py drives the same tabs in Chromium)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from engine import EngineConfig
from engine.core.block_manager import BlockSnapshot
from engine.telemetry.ceilings import DeviceCeilings
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
    final = cmp.final_progress()
    assert "3 / 3 requests" in final and "2 sides ran them 2 time(s)" in final
    with pytest.raises(ValueError, match="repeats"):
        BackgroundCompare(spec, [_Side("A")], requests, repeats=0)


# --- KV calculator ---------------------------------------------------------------------------

BF16 = "bf16 / fp16 (2 B)"
FP8 = "fp8 / int8 (1 B)"


def _kv(model="Llama-3-8B (GQA)", seq_len=4096, batch=32, kv=BF16, fraction=0.9, info=None,
        custom=None):  # fmt: skip
    from playground.handlers.kv import parse_inputs

    return parse_inputs(model, "as the model", seq_len, batch, kv, BF16, "H100 SXM 80GB",
                        fraction, info, custom)  # fmt: skip


def test_kv_bars_over_memory_are_red_and_in_the_legend_the_selected_one_outlined():
    from playground.figures.kv import EXCEEDS_COLOR, FITS_COLOR, memory_bars_figure
    from playground.handlers.kv import exceeds

    x = _kv(batch=8)  # 8 x 0.54 GB fits; 256 x 0.54 GB does not
    assert not exceeds(x, 8) and exceeds(x, 256)
    fig = memory_bars_figure(x)
    fits, over = (t for t in fig.data if t.type == "bar" and t.name.startswith("KV cache"))
    assert fits.marker.color == FITS_COLOR and over.marker.color == EXCEEDS_COLOR
    assert "exceed" in over.name and over.showlegend is not False  # red is in the legend
    labels = list(over.x)
    assert over.y[labels.index("256")] is not None and over.y[labels.index("8")] is None
    assert fits.y[labels.index("8")] is not None
    assert fits.marker.line.width[labels.index("8")] == 3  # the selected batch, outlined
    assert fits.marker.line.width[labels.index("1")] == 0
    assert any(t.name.startswith("selected batch") for t in fig.data)
    assert fig.layout.yaxis.title.text.startswith("GB")


def test_kv_fraction_and_context_are_validated_with_messages():
    x = _kv(fraction=0.3)  # below the old slider's 0.5 minimum: fine now
    assert x.memory_fraction == 0.3
    for bad in (0, 1.5, None, float("nan"), -1):
        with pytest.raises(ValueError, match="memory fraction"):
            _kv(fraction=bad)
    with pytest.raises(ValueError, match="maximum of 8,192"):
        _kv(seq_len=1_000_000)  # Llama-3-8B: 8,192 tokens


def test_kv_custom_model_and_one_unit_system():
    from playground.handlers.kv import CUSTOM_MODEL, CustomModel, formula_markdown, table_rows

    x = _kv(CUSTOM_MODEL, seq_len=1000, batch=1, custom=CustomModel(10, 8, 2, 64, 1.0))
    assert x.kv() == 2 * 10 * 2 * 64 * 1000 * 2
    assert x.weights_bytes == 2e9  # 1 B params x 2 B
    md = formula_markdown(x)
    assert "GiB" not in md and "MiB" not in md and "KiB" not in md and "5.12 MB" in md
    headers, _ = table_rows(x)
    assert not any("model max" in h for h in headers)  # a custom model: no known limit
    with pytest.raises(ValueError, match="custom KV heads"):
        _kv(CUSTOM_MODEL, custom=CustomModel(10, 8, 3, 64, 1.0))
    with pytest.raises(ValueError, match="custom layers"):
        _kv(CUSTOM_MODEL, custom=CustomModel(None, 8, 2, 64, 1.0))
    headers, rows = table_rows(_kv("Llama-2-7B (MHA)"))  # a 4,096-token model
    assert headers[3] == "4,096" and headers[4] == "8,192 (> model max)"
    assert rows[0][4].startswith("(") and not rows[0][3].startswith("(")


def test_kv_loaded_model_uses_the_engines_kv_element_not_the_form():
    from playground.engine_info import EngineInfo
    from playground.handlers.kv import LOADED_MODEL, formula_markdown

    shape = EngineInfo.__dataclass_fields__["shape"]
    assert shape  # the EngineInfo fields used below exist
    from engine.runner.models.presets import MODEL_PRESETS
    from engine.telemetry.cost import ModelShape

    info = SimpleNamespace(model_name="smollm2-135m", max_model_len=1024,
                           shape=ModelShape.from_arch(MODEL_PRESETS["smollm2-135m"]),
                           config=EngineConfig(), dtype="bfloat16", weight_bytes=269_030_016)  # fmt: skip
    x = _kv(LOADED_MODEL, seq_len=512, batch=1, kv=FP8, info=info)
    assert x.kv_bytes == 2.0  # the engine's bf16 cache, not the leftover fp8 choice
    assert "the loaded engine's own, 2 B" in formula_markdown(x)
    with pytest.raises(ValueError, match="maximum of 1,024"):
        _kv(LOADED_MODEL, seq_len=2048, info=info)


# --- Roofline --------------------------------------------------------------------------------


def _roof(bandwidth: float, bf16: float, name: str = "cpu-test") -> DeviceCeilings:
    peaks = {"float32": bf16 / 2, "bfloat16": bf16, "float16": bf16}
    return DeviceCeilings(name, peaks, bandwidth, True, "measured on cpu: test")


def test_remeasure_keeps_the_best_of_repeats_and_never_silently_lowers_the_roof(
    tmp_path, monkeypatch
):
    from engine.telemetry import ceilings as ceilings_module
    from playground.handlers.roofline import CeilingsProvider, remeasure_note, roofline_view

    monkeypatch.setenv("PLAYGROUND_CACHE_DIR", str(tmp_path))
    ceilings_module.clear_memory_cache()
    busy = iter([_roof(5.75e9, 181e9), _roof(4e9, 150e9), _roof(5e9, 170e9)])
    first = [_roof(16.6e9, 925e9), _roof(12e9, 900e9), _roof(16e9, 700e9)]
    runs = iter(first)
    provider = CeilingsProvider("cpu", measure=lambda device: next(runs))
    monkeypatch.setattr(ceilings_module, "device_name", lambda device="cpu": "cpu-test")
    monkeypatch.setattr(ceilings_module, "measure_ceilings", lambda device="cpu": first[1])
    assert provider.measured().bandwidth_bytes_per_s == 12e9  # measured once, cached
    steps = []
    best, kept = provider.remeasure(on_progress=lambda i, n: steps.append((i, n)))
    assert kept and steps == [(0, 3), (1, 3), (2, 3)]
    assert best.bandwidth_bytes_per_s == 16.6e9 and best.peak("bfloat16") == 925e9  # best of 3
    assert "best of 3 runs" in best.source and "UTC" in best.source and "±28%" in best.source
    provider._measure = lambda device: next(busy)
    lower, kept = provider.remeasure()
    assert not kept and provider.latest is lower and lower.bandwidth_bytes_per_s == 5.75e9
    assert provider.get("this device (measured)") is best  # the better roof stays shown
    ceilings_module.clear_memory_cache()
    assert ceilings_module.get_ceilings("cpu").bandwidth_bytes_per_s == 16.6e9  # and cached
    note = remeasure_note(lower, kept, best, "bfloat16")
    assert "not kept" in note and "181 GFLOP/s" in note and "925 GFLOP/s" in note
    _, text = roofline_view(provider, "this device (measured)", "bfloat16", [])
    assert text.startswith(note)  # every redraw says which roof is shown and why
    ceilings_module.clear_memory_cache()


def test_roofline_axes_in_one_notation_and_the_ridge_label_beside_its_line():
    from engine.telemetry.ceilings import PRESETS
    from playground.figures.roofline import roofline_figure

    fig = roofline_figure(PRESETS["H100 SXM"], "bfloat16", [])
    y_text = list(fig.layout.yaxis.ticktext)
    assert "1 PFLOP/s" in y_text and "100 TFLOP/s" in y_text
    assert all(t.endswith("FLOP/s") and "^" not in t and "e+" not in t for t in y_text)
    assert list(fig.layout.xaxis.ticktext)[:3] == ["0.1", "1", "10"]
    ridge = next(a for a in fig.layout.annotations if a.text.startswith("ridge"))
    assert ridge.xanchor == "left" and ridge.xshift > 0  # starts right of the dotted line


# --- Latency ---------------------------------------------------------------------------------


def _stats_with_history(now: float, steps_from: float, finished_at: list[float], dropped: bool):
    from dataclasses import replace as dc_replace

    from engine.request import RequestMetrics
    from engine.telemetry.stats import EngineStats, FinishedRequest, StepStats

    template = StepStats(step_index=0, start_time=0.0, duration_s=0.01, kind="decode",
                         num_prefill_tokens=0, num_decode_tokens=4, num_prefill_reqs=0,
                         num_decode_reqs=4, batch_size=4, num_running=4, num_waiting=0,
                         num_preemptions=0, num_blocks_used=8, num_blocks_free=56,
                         num_kv_blocks=64, flops=4e9, bytes_moved=3e8)  # fmt: skip
    steps = [dc_replace(template, step_index=i, start_time=t)
             for i, t in enumerate(range(int(steps_from), int(now), 5))]  # fmt: skip
    finished = []
    for i, t in enumerate(finished_at):
        m = RequestMetrics(arrival_time=t - 1.0, first_scheduled_time=t - 0.9,
                           first_token_time=t - 0.8, finish_time=t,
                           token_times=[t - 0.8, t - 0.4, t], num_output_tokens=3)  # fmt: skip
        finished.append(FinishedRequest(f"r{i}", "length", m))
    total = len(steps) + (10_000 if dropped else 0)
    return EngineStats(64, 56, 16, 1 << 20, 0, 0, 0, total, steps=steps, finished=finished)


def test_latency_cdfs_and_throughput_cover_the_same_window():
    from playground.handlers.latency import latency_view, shared_window_start

    now = 2000.0
    # Steps kept for the last ~450 s only (the ring dropped older ones); requests for 20 min.
    stats = _stats_with_history(now, now - 450, [now - 1200, now - 900, now - 300, now - 10],
                                dropped=True)  # fmt: skip
    assert shared_window_start(stats, math.inf, now) == now - 450
    view = latency_view(stats, "all kept", now=now)
    assert view.table[0][1] == 2  # only the requests inside the steps' 450 s
    assert "last 7.5 min" in view.cdfs.layout.title.text
    assert "last 7.5 min" in view.throughput.layout.title.text
    assert "keeps its last" in view.summary_md and "same last 7.5 min" in view.summary_md
    # A 60 s window within the kept steps: both charts say the same 60 s; nothing cut.
    short = latency_view(stats, "last 60 s", now=now)
    assert short.table[0][1] == 1 and "last 60 s" in short.cdfs.layout.title.text
    assert "last 60 s" in short.throughput.layout.title.text
    assert "keeps its last" not in short.summary_md
    # Nothing dropped: "all kept" is all of it, the four requests.
    whole = _stats_with_history(now, now - 1300, [now - 1200, now - 10], dropped=False)
    assert latency_view(whole, "all kept", now=now).table[0][1] == 2


# --- Load test -------------------------------------------------------------------------------


def test_a_stopped_load_test_counts_its_aborted_requests():
    from playground.handlers.loadtest import BackgroundRun

    class Slow(_SlowTarget):
        async def send(self, request, spec):
            if request.index > 0:
                await asyncio.sleep(30)  # in flight until Stop aborts it
            return await super().send(request, spec)

    spec = WorkloadSpec(num_prompts=24, request_rate=math.inf)
    requests = [GenRequest(i, [5, 6], 2, 1) for i in range(24)]
    run = BackgroundRun(spec, Slow(), requests).start()
    deadline = time.perf_counter() + 10
    while not run.results and time.perf_counter() < deadline:
        time.sleep(0.01)
    run.stop()
    assert run.done.wait(10) and run.stopped
    assert run.result.summary()["completed"] == 1 and run.num_aborted == 23


def test_workload_form_hides_what_the_distribution_does_not_use():
    import gradio as gr

    from playground.tabs.workload_form import KIND_FIELDS, workload_form

    assert KIND_FIELDS["fixed"] == ("mean",) and "std" in KIND_FIELDS["normal"]
    with gr.Blocks():
        form = workload_form(DEFAULT_COMPARE_WORKLOAD, list(DEFAULT_COMPARE_WORKLOAD))
    assert form["input_mean"].visible is False and form["input_low"].visible is not False
    assert form["request_rate"].visible is False  # all at once: no rate
    assert form["burstiness"].visible is False
    assert all(len(c.label) <= 24 for c in form.values() if isinstance(c, gr.Number))


def test_a_32_entry_block_map_legend_is_folded_so_the_map_keeps_its_room():
    from playground.figures.blocks import block_map_figure
    from playground.tabs.compare import MAX_LEGEND_ENTRIES, compact_legend

    # Contiguous: 16 requests, each with used and reserved blocks: 32 owner categories.
    states, owners = [], []
    for r in range(16):
        states += ["used", "reserved"]
        owners += [f"req-{r}", f"req-{r}"]
    snap = BlockSnapshot(32, 16, "contiguous", states, owners, [16, 0] * 16, [1, 1] * 16)
    fig = compact_legend(block_map_figure(snap, "A at peak"))
    shown = [t for t in fig.data if t.type == "scatter" and t.showlegend is not False and t.name]
    assert len(shown) <= MAX_LEGEND_ENTRIES
    assert shown[-1].name.startswith("+") and "hover a cell" in shown[-1].name
