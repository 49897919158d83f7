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

from playground.handlers.loadtest import BackgroundRun, _whole, progress_html
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
    result: LoadTestResult | None = None  # the last repeat (the figures draw it)
    runs: list[LoadTestResult] = field(default_factory=list)  # every finished repeat, in order
    peak: BlockSnapshot | None = None  # the block map at peak usage (engine sides)
    steps: list[StepStats] = field(default_factory=list)  # the run's engine steps (engine sides)
    load_s: float = 0.0  # seconds to make the side ready (engine: model load)
    weight_bytes: int | None = None  # the engine's weights as stored (None: a remote server)
    perplexity: float | None = None  # on held-out text, after the run (engine sides)
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
    """Runs the sides one after the other in a thread: start, run the load test `repeats`
    times, finish. Repeats reuse the side's target, so they need one that runs again after
    aclose() (EngineTarget; a remote side's HTTP client closes: the remote tab runs once)."""

    def __init__(
        self,
        spec: WorkloadSpec,
        sides: list[CompareSide],
        requests: list[GenRequest],
        repeats: int = 1,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {repeats}")
        self.spec = spec
        self.requests = requests
        self.sides = sides
        self.repeats = repeats
        self.runs_done = 0  # load tests finished so far, over both sides (the progress bar)
        self.outcomes = [SideOutcome(s.name, s.label, s.config) for s in sides]
        self.phase = "starting"
        self.current: BackgroundRun | None = None
        self.done = threading.Event()
        self._stopped = False
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._main, name="compare", daemon=True)

    def start(self) -> BackgroundCompare:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        if self.current is not None:
            self.current.stop()

    @property
    def total_requests(self) -> int:
        """Requests over the whole compare: every repeat of every side."""
        return len(self.requests) * self.repeats * len(self.sides)

    def progress(self) -> str:
        """One bar for the whole compare (A's repeats, then B's): it only moves forward."""
        run = self.current
        done = self.runs_done * len(self.requests) + (len(run.results) if run else 0)
        elapsed = time.perf_counter() - self._t0
        return progress_html(done, self.total_requests, elapsed, self.phase)

    def final_progress(self) -> str:
        """The full bar once both sides ran, counted per run (every run sent the same
        requests); the seconds are the runs' own, summed."""
        elapsed = sum(r.duration_s for o in self.outcomes for r in o.runs)
        if self._stopped:
            done = sum(len(r.per_request) for o in self.outcomes for r in o.runs)
            return progress_html(done, self.total_requests, elapsed, "stopped")
        n = len(self.requests)
        note = f"done: each of the {len(self.sides)} sides ran them {self.repeats} time(s)"
        return progress_html(n, n, elapsed, note)

    def running_status(self) -> str:
        """The status line while the compare runs (never the previous run's result)."""
        return (
            f"**Running the compare:** {self.phase}. Each side runs the same "
            f"{len(self.requests)} requests {self.repeats} time(s); the table fills in when "
            "both sides are done."
        )

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
            for repeat in range(self.repeats):
                if self._stopped and run is not None:
                    break
                self.phase = f"{outcome.label}: run {repeat + 1} of {self.repeats}"
                run = BackgroundRun(self.spec, target, self.requests)
                self.current = run
                if self._stopped:  # stopped while the side was starting
                    run.stop()
                run.start().done.wait()
                outcome.result, outcome.error = run.result, run.error
                if run.result is not None:
                    outcome.runs.append(run.result)
                self.runs_done += 1
                self.current = None
                if run.error or run.stopped:
                    break
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
    ("KV pool (blocks)", "pool_blocks", None),
    ("Peak KV blocks held", "peak_blocks", "lower"),
    ("Peak KV tokens held (blocks x block size)", "peak_kv_tokens", "lower"),
    ("Engine steps", "num_steps", "lower"),
    ("Mean requests per step", "mean_batch", "higher"),
    ("Most requests running at once", "max_running", "higher"),
    ("Preemptions", "preemptions", "lower"),
    ("Prompt tokens computed (prefill)", "prefill_tokens", "lower"),
    ("Prompt tokens from the prefix cache", "prefix_hit_tokens", "higher"),
    ("Draft tokens verified (speculative)", "draft_tokens", None),
    ("Draft tokens accepted", "accepted_tokens", "higher"),
    ("Engine start-up (s, not in the run)", "load_s", None),
    ("Weight memory (MB, as stored)", "weight_mb", "lower"),
    ("Output tokens same as A (%, greedy runs)", "same_tokens_pct", "higher"),
    ("Held-out perplexity (256 tokens of pydoc text)", "perplexity", "lower"),
)
COMPARE_HEADERS = ["metric", "A", "B", "B / A", "better", "noise band"]
# A side "wins" a row only when the two differ by more than this fraction, or by more than
# either side's own spread over its repeats when that is wider: a shared 2-core CPU moves
# timings by a few percent from run to run.
NOISE_FRACTION = 0.05
MAX_RUNS_PER_SIDE = 5  # each run repeats the whole workload on both sides


def runs_per_side(value: Any) -> int:
    """The form's "runs per side": a whole number in 1..MAX_RUNS_PER_SIDE (ValueError)."""
    runs = _whole("runs per side", value)
    if runs > MAX_RUNS_PER_SIDE:
        raise ValueError(
            f"runs per side: at most {MAX_RUNS_PER_SIDE} (each run repeats the whole workload)"
        )
    return runs


HEADLINE_MARK = "★ "
NOISE_NOTE = (
    f"'better' marks a side only when A and B differ by more than {NOISE_FRACTION:.0%} and by "
    "more than either side's spread over its repeats ((max - min) / median, the 'noise band'); "
    "timed rows are medians of the repeats; engine rows (steps, blocks, tokens) are the last "
    "repeat's. ★ marks the preset's headline row."
)


def outcome_metrics(outcome: SideOutcome) -> dict[str, Any]:
    """Each row's value: the median over the repeats for the client's numbers, the last
    repeat's engine counters (deterministic for a seeded, greedy workload)."""
    runs = outcome.runs or ([outcome.result] if outcome.result else [])
    m: dict[str, Any] = _median_summary([r.summary() for r in runs])
    steps = [s for s in outcome.steps if s.batch_size]
    if outcome.peak is not None:
        # The polled block map can miss a peak shorter than its interval (a tiny model's
        # steps); every step records the blocks held after it, so take the larger.
        peak = max([blocks_held(outcome.peak), *(s.num_blocks_used for s in steps)])
        m["peak_blocks"] = peak
        m["peak_kv_tokens"] = peak * outcome.peak.block_size
        m["pool_blocks"] = outcome.peak.num_blocks
    m["num_steps"] = len(steps)
    m["mean_batch"] = statistics.fmean(s.batch_size for s in steps) if steps else None
    m["max_running"] = max((s.num_running for s in steps), default=None)
    m["preemptions"] = sum(s.num_preemptions for s in steps)
    m["prefill_tokens"] = sum(s.num_prefill_tokens for s in steps)
    m["prefix_hit_tokens"] = sum(s.num_prefix_hit_tokens for s in steps)
    m["draft_tokens"] = sum(s.num_draft_tokens for s in steps)
    m["accepted_tokens"] = sum(s.num_accepted_tokens for s in steps)
    m["load_s"] = outcome.load_s
    if outcome.weight_bytes is not None:
        m["weight_mb"] = outcome.weight_bytes / 1e6
    if outcome.perplexity is not None:
        m["perplexity"] = outcome.perplexity
    return m


def same_tokens_pct(a: SideOutcome, b: SideOutcome) -> float | None:
    """Of A's output tokens in the last run, the percentage B produced at the same position
    of the same request: greedy agreement (a quantized B against an unquantized A). After
    the first difference B continues from another prefix, so later positions mostly differ
    too. None unless both sides ran greedy (temperature 0) on an engine that reports ids."""
    if not a.runs or not b.runs or a.runs[-1].spec.temperature or b.runs[-1].spec.temperature:
        return None
    theirs = {r.index: r.output_token_ids for r in b.runs[-1].per_request if r.success}
    same = total = 0
    for r in a.runs[-1].per_request:
        other = theirs.get(r.index)
        if not r.success or r.output_token_ids is None or other is None:
            continue
        total += len(r.output_token_ids)
        same += sum(x == y for x, y in zip(r.output_token_ids, other, strict=False))
    return 100.0 * same / total if total else None


def _median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    if not summaries:
        return {}
    out = dict(summaries[-1])
    for key, value in summaries[-1].items():
        values = [s.get(key) for s in summaries]
        if isinstance(value, int | float) and all(isinstance(v, int | float) for v in values):
            # Counts stay whole (median_low picks one of them); timings take the true median.
            ints = all(isinstance(v, int) for v in values)
            out[key] = statistics.median_low(values) if ints else statistics.median(values)
    return out


def outcome_spreads(outcome: SideOutcome) -> dict[str, float]:
    """(max - min) / |median| of each summary number over the repeats (0 with one repeat)."""
    summaries = [r.summary() for r in outcome.runs]
    spreads: dict[str, float] = {}
    for key in summaries[0] if summaries else ():
        values = [s.get(key) for s in summaries]
        if all(isinstance(v, int | float) for v in values) and len(values) > 1:
            median = statistics.median(values)
            spreads[key] = (max(values) - min(values)) / abs(median) if median else 0.0
    return spreads


def winner(va: Any, vb: Any, better: str | None, band: float) -> str:
    """ "A", "B", "≈" (within the noise band) or "" (no better direction, no value, equal)."""
    if not better or not isinstance(va, int | float) or not isinstance(vb, int | float):
        return ""
    if va == vb:
        return ""
    if abs(vb - va) / max(abs(va), abs(vb)) <= band:
        return "≈"
    return "B" if (vb > va) == (better == "higher") else "A"


def compare_rows(
    a: SideOutcome,
    b: SideOutcome,
    which: tuple[tuple[str, str, str | None], ...] = COMPARE_ROWS,
    headline: str | None = None,
) -> list[list[str]]:
    """One row per metric: A, B, B / A, the winner beyond the noise band, the band. The
    headline row (a COMPARE_ROWS label) comes first, marked with HEADLINE_MARK."""
    ma, mb = outcome_metrics(a), outcome_metrics(b)
    agreement = same_tokens_pct(a, b)
    if agreement is not None:
        ma["same_tokens_pct"], mb["same_tokens_pct"] = 100.0, agreement
    sa, sb = outcome_spreads(a), outcome_spreads(b)
    rows = []
    for label, key, better in which:
        va, vb = ma.get(key), mb.get(key)
        ratio = f"x{vb / va:.2f}" if isinstance(va, int | float) and va and vb is not None else "-"
        band = max(NOISE_FRACTION, sa.get(key, 0.0), sb.get(key, 0.0))
        row = [label, _fmt(va), _fmt(vb), ratio, winner(va, vb, better, band), f"±{band:.0%}"]
        if label == headline:
            rows.insert(0, [HEADLINE_MARK + label, *row[1:]])
        else:
            rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
