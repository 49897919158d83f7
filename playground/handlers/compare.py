"""Compare logic: two engine configurations, each in its own EngineService, run one after the
other on the same seeded requests; the block map kept at each side's peak usage.

The same code serves both sides (DESIGN.md, "Baselines live in the same engine"): only the
EngineConfig fields in SIDE_FIELDS differ, and the KV budget is fixed in tokens so a bigger
block size gets fewer blocks of the same total bytes.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockSnapshot
from engine.telemetry.stats import StepStats
from playground.handlers.loadtest import BackgroundRun, progress_html
from playground.loadgen import EngineTarget, GenRequest, LoadTestResult, WorkloadSpec

SIDE_FIELDS = (
    "batching",
    "kv_layout",
    "enable_prefix_caching",
    "speculative_method",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
)
BLOCK_SIZES = (8, 16, 32, 64)
DEFAULT_SIDE: dict[str, Any] = {
    "batching": "continuous",
    "kv_layout": "paged",
    "enable_prefix_caching": False,
    "speculative_method": "off",
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
}
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "static vs continuous batching": ({"batching": "static"}, {"batching": "continuous"}),
    "contiguous vs paged KV": ({"kv_layout": "contiguous"}, {"kv_layout": "paged"}),
    "max_num_seqs 2 vs 8": ({"max_num_seqs": 2}, {"max_num_seqs": 8}),
    "block size 64 vs 16": ({"block_size": 64}, {"block_size": 16}),
    "prefix caching off vs on (shared prompt prefix)": (
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
    ),
    "speculative decoding off vs n-gram": (
        {"speculative_method": "off", "max_num_seqs": 2},
        {"speculative_method": "ngram", "max_num_seqs": 2},
    ),
    "token budget 32 vs 256 (chunked prefill)": (
        {"max_num_batched_tokens": 32},
        {"max_num_batched_tokens": 256},
    ),
}
DEFAULT_PRESET = "static vs continuous batching"
# Workload fields a preset sets too: prefix caching only pays off on prompts that share a prefix.
PRESET_WORKLOAD: dict[str, dict[str, Any]] = {
    "prefix caching off vs on (shared prompt prefix)": {"prefix_len": 192},
}
# Small enough for a 2-core CPU: each side finishes in seconds with the embedded model.
DEFAULT_COMPARE_WORKLOAD: dict[str, Any] = {
    "num_prompts": 16,
    "arrival": "all at once",
    "input_kind": "uniform",
    "input_low": 16,
    "input_high": 64,
    "output_kind": "uniform",
    "output_low": 4,
    "output_high": 24,
    "seed": 0,
    "temperature": 0.0,
    "ignore_eos": True,
    "max_concurrency": 0,
    "prefix_len": 0,
}
DEFAULT_KV_BUDGET_TOKENS = 4096
DEFAULT_MAX_MODEL_LEN = 512


def preset_sides(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if name not in PRESETS:
        raise ValueError(f"preset: pick one of {', '.join(PRESETS)}")
    a, b = PRESETS[name]
    return {**DEFAULT_SIDE, **a}, {**DEFAULT_SIDE, **b}


def side_config(
    base: EngineConfig, side: Mapping[str, Any], kv_budget_tokens: Any, max_model_len: Any
) -> EngineConfig:
    """The main engine's model, device and dtype with this side's scheduling and KV fields."""
    values = {}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        v = side[name]
        if v is None or v != int(v) or v < 1:
            raise ValueError(f"{name}: must be a positive whole number, got {v!r}")
        values[name] = int(v)
    for name, v in (("KV budget", kv_budget_tokens), ("max_model_len", max_model_len)):
        if v is None or v != int(v) or v < 1:
            raise ValueError(f"{name}: must be a positive whole number, got {v!r}")
    num_blocks = int(kv_budget_tokens) // values["block_size"]
    if num_blocks < 1:
        raise ValueError(
            f"KV budget: {kv_budget_tokens} tokens hold no block of {values['block_size']}"
        )
    prefix_caching = bool(side.get("enable_prefix_caching", False))
    if side["kv_layout"] == "contiguous" and prefix_caching:
        raise ValueError("prefix caching: needs the paged KV layout (blocks are what is shared)")
    if (
        side["kv_layout"] == "contiguous"
        and -(-int(max_model_len) // values["block_size"]) > num_blocks
    ):
        raise ValueError(
            f"KV budget: with the contiguous layout each request reserves max_model_len = "
            f"{int(max_model_len)} tokens, more than the {kv_budget_tokens}-token budget"
        )
    return base.replace(
        batching=side["batching"],
        kv_layout=side["kv_layout"],
        enable_prefix_caching=prefix_caching,
        speculative_method=side.get("speculative_method", "off"),
        num_kv_blocks=num_blocks,
        max_model_len=int(max_model_len),
        **values,
    )


def side_label(name: str, side: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    diff = [f"{k}={side[k]}" for k in SIDE_FIELDS if side[k] != other[k]]
    return f"{name}: {', '.join(diff) if diff else 'same config'}"


class PeakPoller:
    """Polls block_snapshot() and keeps the one with the most blocks held."""

    def __init__(self, service: Any, interval_s: float = 0.1) -> None:
        self.service = service
        self.interval_s = interval_s
        self.peak: BlockSnapshot = service.block_snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-poller", daemon=True)

    @staticmethod
    def used(snapshot: BlockSnapshot) -> int:
        return snapshot.num_blocks - snapshot.num_free

    def start(self) -> PeakPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            snap = self.service.block_snapshot()
            if self.used(snap) > self.used(self.peak):
                self.peak = snap

    def stop(self) -> BlockSnapshot:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class SideOutcome:
    name: str  # "A" or "B"
    label: str
    config: EngineConfig | None  # None: a remote server (handlers_compare_remote)
    result: LoadTestResult | None = None
    peak: BlockSnapshot | None = None
    steps: list[StepStats] = field(default_factory=list)
    load_s: float = 0.0  # seconds to build the engine (model load)
    error: str | None = None


class BackgroundCompare:
    """Runs the sides one after the other in a thread: build engine, run, keep peak, shut down."""

    def __init__(
        self,
        spec: WorkloadSpec,
        sides: list[tuple[str, str, EngineConfig | None]],
        requests: list[GenRequest],
        make_service: Callable[[EngineConfig], Any],
    ) -> None:
        self.spec = spec
        self.requests = requests
        self.make_service = make_service
        self.outcomes = [SideOutcome(name, label, cfg) for name, label, cfg in sides]
        self.phase = "starting"
        self.current: BackgroundRun | None = None
        self.done = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name="compare", daemon=True)

    def start(self) -> BackgroundCompare:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        if self.current is not None:
            self.current.stop()

    def progress(self) -> str:
        """The progress bar of the side running now (0 done between the sides)."""
        run = self.current
        done = len(run.results) if run else 0
        elapsed = run.elapsed_s if run else 0.0
        return progress_html(done, len(self.requests), elapsed, self.phase)

    def final_progress(self) -> str:
        """The full bar once both sides ran: the seconds are the two runs' own, summed."""
        elapsed = sum(o.result.duration_s for o in self.outcomes if o.result)
        total = len(self.requests)
        return progress_html(total, total, elapsed, "done (both runs)")

    def problems(self) -> str:
        """Markdown to append to the status: each side's error, or "" when none failed."""
        errors = [f"{o.label}: {o.error}" for o in self.outcomes if o.error]
        return "\n\n**Problems:** " + "; ".join(errors) if errors else ""

    def _main(self) -> None:
        try:
            for outcome in self.outcomes:
                if self._stopped:
                    outcome.error = "not run (stopped)"
                    continue
                self._run_side(outcome)
        finally:
            self.phase = "done"
            self.done.set()

    def _run_side(self, outcome: SideOutcome) -> None:
        self.phase = f"{outcome.label}: loading the model"
        t0 = time.perf_counter()
        try:
            service = self.make_service(outcome.config)
        except Exception as e:  # a config the engine refuses: report it, go on
            outcome.error = f"engine did not start: {e}"
            return
        outcome.load_s = time.perf_counter() - t0
        poller = None
        try:
            self.phase = f"{outcome.label}: running"
            poller = PeakPoller(service).start()
            run = BackgroundRun(self.spec, EngineTarget(service), self.requests)
            self.current = run
            if self._stopped:  # stopped while the engine was loading
                run.stop()
            run.start().done.wait()
            outcome.result, outcome.error = run.result, run.error
            outcome.steps = [s for s in service.stats().steps if s.start_time >= run.start_time]
        finally:
            if poller is not None:
                outcome.peak = poller.stop()
            self.current = None
            self.phase = f"{outcome.label}: shutting down"
            service.shutdown()


# --- results side by side --------------------------------------------------------------------

# (label, summary key or engine metric, which is better: "higher" | "lower" | None)
COMPARE_ROWS = (
    ("Successful requests", "completed", "higher"),
    ("Failed requests", "failed", "lower"),
    ("Benchmark duration (s)", "duration_s", "lower"),
    ("Request throughput (req/s)", "request_throughput", "higher"),
    ("Output token throughput (tok/s)", "output_throughput", "higher"),
    ("Total token throughput (tok/s)", "total_token_throughput", "higher"),
    ("Mean TTFT (ms)", "mean_ttft_ms", "lower"),
    ("Median TTFT (ms)", "median_ttft_ms", "lower"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "lower"),
    ("Mean TPOT (ms)", "mean_tpot_ms", "lower"),
    ("P99 TPOT (ms)", "p99_tpot_ms", "lower"),
    ("Mean ITL (ms)", "mean_itl_ms", "lower"),
    ("P99 ITL (ms)", "p99_itl_ms", "lower"),
    ("Mean E2E latency (ms)", "mean_e2el_ms", "lower"),
    ("Peak KV blocks held", "peak_blocks", None),
    ("Engine steps", "num_steps", "lower"),
    ("Mean requests per step", "mean_batch", "higher"),
    ("Preemptions", "preemptions", "lower"),
    ("Prompt tokens computed (prefill)", "prefill_tokens", "lower"),
    ("Prompt tokens from the prefix cache", "prefix_hit_tokens", "higher"),
    ("Draft tokens verified (speculative)", "draft_tokens", None),
    ("Draft tokens accepted", "accepted_tokens", "higher"),
    ("Engine start-up (s, not in the run)", "load_s", None),
)
COMPARE_HEADERS = ["metric", "A", "B", "B / A", "better"]


def outcome_metrics(outcome: SideOutcome) -> dict[str, Any]:
    m: dict[str, Any] = dict(outcome.result.summary()) if outcome.result else {}
    steps = [s for s in outcome.steps if s.batch_size]
    if outcome.peak is not None:
        m["peak_blocks"] = PeakPoller.used(outcome.peak)
    m["num_steps"] = len(steps)
    m["mean_batch"] = statistics.fmean(s.batch_size for s in steps) if steps else None
    m["preemptions"] = sum(s.num_preemptions for s in steps)
    m["prefill_tokens"] = sum(s.num_prefill_tokens for s in steps)
    m["prefix_hit_tokens"] = sum(s.num_prefix_hit_tokens for s in steps)
    m["draft_tokens"] = sum(s.num_draft_tokens for s in steps)
    m["accepted_tokens"] = sum(s.num_accepted_tokens for s in steps)
    m["load_s"] = outcome.load_s
    return m


def compare_rows(
    a: SideOutcome, b: SideOutcome, which: tuple[tuple[str, str, str | None], ...] = COMPARE_ROWS
) -> list[list[str]]:
    ma, mb = outcome_metrics(a), outcome_metrics(b)
    rows = []
    for label, key, better in which:
        va, vb = ma.get(key), mb.get(key)
        ratio = f"x{vb / va:.2f}" if isinstance(va, int | float) and va and vb is not None else "-"
        winner = ""
        if better and va is not None and vb is not None and va != vb:
            winner = "B" if (vb > va) == (better == "higher") else "A"
        rows.append([label, _fmt(va), _fmt(vb), ratio, winner])
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
