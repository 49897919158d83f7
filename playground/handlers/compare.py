"""Compare logic: the same seeded requests against two sides, one after the other, and their
numbers side by side. A side is a CompareSide: an engine configuration in its own EngineService
(handlers/compare_engine.py) or an OpenAI-compatible server (handlers/compare_remote.py).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from playground.handlers.loadtest import BackgroundRun, progress_html
from playground.loadgen import GenRequest, LoadTestResult, Target, WorkloadSpec

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.block_manager import BlockSnapshot
    from engine.telemetry.stats import StepStats


def blocks_held(snapshot: BlockSnapshot) -> int:
    return snapshot.num_blocks - snapshot.num_free


@dataclass
class SideOutcome:
    name: str  # "A" or "B"
    label: str
    config: EngineConfig | None  # None: a remote server
    result: LoadTestResult | None = None
    peak: BlockSnapshot | None = None  # the block map at peak usage (engine sides)
    steps: list[StepStats] = field(default_factory=list)  # the run's engine steps (engine sides)
    load_s: float = 0.0  # seconds to make the side ready (engine: model load)
    error: str | None = None


class CompareSide(Protocol):
    """One side of a compare: made ready, driven as a load test, then finished."""

    name: str  # "A" | "B"
    label: str  # "A: batching=static", for the status and figures
    config: EngineConfig | None  # the engine configuration it runs (None: a remote server)
    starting: str  # the phase shown while start() runs ("loading the model")
    finishing: str  # the phase shown while finish() runs ("shutting down")

    def start(self) -> Target:
        """Ready to take the requests (may take seconds); an exception says why it refused."""
        ...

    def finish(self, outcome: SideOutcome, run: BackgroundRun | None) -> None:
        """Keeps what only this side can tell (engine steps, peak block map) in the outcome and
        releases what start() took. run: the load test, None when it never began."""
        ...


class BackgroundCompare:
    """Runs the sides one after the other in a thread: start, run the load test, finish."""

    def __init__(
        self, spec: WorkloadSpec, sides: list[CompareSide], requests: list[GenRequest]
    ) -> None:
        self.spec = spec
        self.requests = requests
        self.sides = sides
        self.outcomes = [SideOutcome(s.name, s.label, s.config) for s in sides]
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
            for side, outcome in zip(self.sides, self.outcomes, strict=True):
                if self._stopped:
                    outcome.error = "not run (stopped)"
                    continue
                self._run_side(side, outcome)
        finally:
            self.phase = "done"
            self.done.set()

    def _run_side(self, side: CompareSide, outcome: SideOutcome) -> None:
        self.phase = f"{outcome.label}: {side.starting}"
        t0 = time.perf_counter()
        try:
            target = side.start()
        except Exception as e:  # a side that refuses (a config the engine rejects): go on
            outcome.error = str(e)
            return
        outcome.load_s = time.perf_counter() - t0
        run = None
        try:
            self.phase = f"{outcome.label}: running"
            run = BackgroundRun(self.spec, target, self.requests)
            self.current = run
            if self._stopped:  # stopped while the side was starting
                run.stop()
            run.start().done.wait()
            outcome.result, outcome.error = run.result, run.error
        finally:
            self.current = None
            self.phase = f"{outcome.label}: {side.finishing}"
            side.finish(outcome, run)


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
        m["peak_blocks"] = blocks_held(outcome.peak)
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
