"""Load test logic: the workload form -> WorkloadSpec, a load test running in its own thread and
event loop (so chat and the live tabs keep responding), and its results as tables and JSON.

The load generator itself is playground/loadgen (run_load_test + EngineTarget); this file only
adapts it to a UI that polls.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from playground.loadgen import (
    GenRequest,
    LengthDist,
    LoadTestResult,
    RequestResult,
    WorkloadSpec,
    run_load_test,
)
from playground.loadgen.targets import Target

ARRIVALS = ("all at once", "Poisson", "gamma (bursty)")
LENGTH_KINDS = ("fixed", "uniform", "normal")
MAX_PROMPTS = 2000  # a UI guard; the CLI has none

# The fields of one length distribution each (what length_dist reads), input then output.
LENGTH_FIELDS = tuple(
    f"{which}_{part}"
    for which in ("input", "output")
    for part in ("kind", "mean", "low", "high", "std")
)
# The form's fields, in the order the tab passes them (one component each).
WORKLOAD_FIELDS = (
    "num_prompts",
    "arrival",
    "request_rate",
    "burstiness",
    "max_concurrency",
    *LENGTH_FIELDS,
    "prefix_len",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",
    "n",
    "seed",
)

DEFAULT_WORKLOAD: dict[str, Any] = {
    "num_prompts": 32,
    "arrival": "Poisson",
    "request_rate": 8.0,
    "burstiness": 0.5,
    "max_concurrency": 0,
    "input_kind": "uniform",
    "input_mean": 64,
    "input_low": 16,
    "input_high": 128,
    "input_std": 16.0,
    "output_kind": "uniform",
    "output_mean": 32,
    "output_low": 8,
    "output_high": 48,
    "output_std": 8.0,
    "prefix_len": 0,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "ignore_eos": True,
    "n": 1,  # samples per prompt (the API's n)
    "seed": 0,
}


def _whole(name: str, value: Any, minimum: int = 1) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or value < minimum:
        raise ValueError(f"{name}: must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def length_dist(which: str, form: Mapping[str, Any]) -> LengthDist:
    kind = form[f"{which}_kind"]
    if kind not in LENGTH_KINDS:
        raise ValueError(f"{which} length: pick one of {', '.join(LENGTH_KINDS)}")
    if kind == "fixed":
        return LengthDist.fixed(_whole(f"{which} tokens", form[f"{which}_mean"]))
    low = _whole(f"{which} min", form[f"{which}_low"])
    high = _whole(f"{which} max", form[f"{which}_high"])
    if low > high:
        raise ValueError(f"{which} length: min {low} > max {high}")
    if kind == "uniform":
        return LengthDist.uniform(low, high)
    std = form[f"{which}_std"]
    if std is None or not std > 0:
        raise ValueError(f"{which} std: must be > 0 for a normal distribution, got {std!r}")
    return LengthDist.normal(_whole(f"{which} mean", form[f"{which}_mean"]), float(std), low, high)


def max_length(dist: LengthDist) -> int:
    """Longest length the distribution can draw (normal: its upper clip, or mean + 4 std)."""
    if dist.kind == "fixed":
        return dist.mean
    if dist.high is not None:
        return dist.high
    return int(dist.mean + 4 * dist.std)


def spec_from_form(values: Mapping[str, Any], max_model_len: int | None = None) -> WorkloadSpec:
    """Form values (WORKLOAD_FIELDS) -> WorkloadSpec; ValueError names the bad field."""
    form = {**DEFAULT_WORKLOAD, **values}
    num_prompts = _whole("number of requests", form["num_prompts"])
    if num_prompts > MAX_PROMPTS:
        raise ValueError(f"number of requests: at most {MAX_PROMPTS} in the UI")
    arrival = form["arrival"]
    if arrival not in ARRIVALS:
        raise ValueError(f"arrivals: pick one of {', '.join(ARRIVALS)}")
    rate, burstiness = math.inf, 1.0
    if arrival != "all at once":
        rate = form["request_rate"]
        if rate is None or not rate > 0:
            raise ValueError(f"request rate: must be > 0 req/s, got {rate!r}")
        if arrival == "gamma (bursty)":
            burstiness = form["burstiness"]
            if burstiness is None or not burstiness > 0:
                raise ValueError(f"burstiness: must be > 0 (1 = Poisson), got {burstiness!r}")
    concurrency = _whole("max concurrency", form["max_concurrency"], minimum=0)
    input_len, output_len = length_dist("input", form), length_dist("output", form)
    prefix = _whole("shared prefix tokens", form["prefix_len"], minimum=0)
    temperature = form["temperature"]
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature!r}")
    top_p = form["top_p"]
    if top_p is None or not 0 < top_p <= 1:
        raise ValueError(f"top-p: must be in (0, 1], got {top_p!r}")
    top_k = form["top_k"]
    if top_k is None or top_k != int(top_k) or top_k < -1 or top_k == 0:
        raise ValueError(f"top-k: must be -1 (off) or a whole number >= 1, got {top_k!r}")
    if max_model_len is not None:
        longest = prefix + max_length(input_len) + max_length(output_len)
        if longest > max_model_len:
            raise ValueError(
                f"lengths: prefix + input + output can reach {longest} tokens, more than the "
                f"engine's max_model_len {max_model_len}; shorten them"
            )
    return WorkloadSpec(
        num_prompts=num_prompts,
        request_rate=float(rate),
        burstiness=float(burstiness),
        max_concurrency=concurrency or None,
        input_len=input_len,
        output_len=output_len,
        prefix_len=prefix,
        seed=_whole("seed", form["seed"], minimum=0),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        ignore_eos=bool(form["ignore_eos"]),
        n=_whole("n (samples per prompt)", form["n"]),
    )


class BackgroundRun:
    """run_load_test in its own thread and event loop. The UI polls `results` (finished so
    far, appended in completion order) and `done`; stop() cancels, which aborts the requests
    in flight and keeps what finished as a partial result."""

    def __init__(
        self, spec: WorkloadSpec, target: Target, requests: list[GenRequest] | None = None
    ) -> None:
        self.spec = spec
        self.target = target
        self.requests = requests
        self.total = spec.num_prompts if requests is None else len(requests)
        self.results: list[RequestResult] = []
        self.result: LoadTestResult | None = None
        self.error: str | None = None
        self.stopped = False
        self.start_time = time.perf_counter()
        self.done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stop_requested = False
        self._thread = threading.Thread(target=self._main, name="load-test", daemon=True)

    def start(self) -> BackgroundRun:
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        finally:
            self.done.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.start_time = time.perf_counter()
        try:
            if self._stop_requested:
                raise asyncio.CancelledError
            self.result = await run_load_test(
                self.spec, self.target, on_progress=self._progress, requests=self.requests
            )
        except asyncio.CancelledError:
            self.stopped = True
            self.result = LoadTestResult(
                self.spec,
                self.target.name,
                self.start_time,
                time.perf_counter(),
                sorted(self.results, key=lambda r: r.index),
                notes=dict(getattr(self.target, "notes", {})),
            )
        except Exception as e:  # a broken workload or target: report it, never a traceback
            self.error = f"{type(e).__name__}: {e}"

    def _progress(self, done: int, total: int, last: RequestResult) -> None:
        self.results.append(last)

    def stop(self) -> None:
        self._stop_requested = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)

    @property
    def num_aborted(self) -> int:
        """Requests Stop cut off: in flight (aborted) or not sent yet; 0 for a full run."""
        if not self.stopped or self.result is None:
            return 0
        return self.total - len(self.result.per_request)

    @property
    def elapsed_s(self) -> float:
        end = self.result.end_time if self.result is not None else time.perf_counter()
        return end - self.start_time


def summary_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """The summary as `vllm bench serve` prints it, one [metric, value] row each."""

    def num(value: Any, digits: int = 2) -> str:
        if value is None:
            return "n/a"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    rows = [
        ["Successful requests", num(summary["completed"])],
        ["Failed requests", num(summary["failed"])],
        ["Benchmark duration (s)", num(summary["duration_s"])],
        ["Total input tokens", num(summary["total_input_tokens"])],
        ["Total generated tokens", num(summary["total_output_tokens"])],
        ["Request throughput (req/s)", num(summary["request_throughput"])],
        ["Output token throughput (tok/s)", num(summary["output_throughput"])],
        ["Total token throughput (tok/s)", num(summary["total_token_throughput"])],
    ]
    for key, short in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for stat in ("mean", "median", "p99"):
            label = {"mean": "Mean", "median": "Median", "p99": "P99"}[stat]
            rows.append([f"{label} {short} (ms)", num(summary.get(f"{stat}_{key}_ms"))])
    for reason, count in (summary.get("errors") or {}).items():
        rows.append([f"Failed x{count}", reason])
    return rows


def write_result_json(result: LoadTestResult, prefix: str = "loadtest") -> str:
    """The full result (spec, summary, every request's timeline) in a fresh temp file."""
    return write_download(result.to_json(), prefix)


def write_download(json_text: str, prefix: str) -> str:
    """json_text in a fresh temp file named <prefix>-<time>.json (a download button's value)."""
    folder = Path(tempfile.mkdtemp(prefix="playground-"))
    path = folder / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json_text, encoding="utf-8")
    return str(path)


def progress_html(done: int, total: int, elapsed_s: float, note: str = "") -> str:
    pct = 100.0 * done / total if total else 0.0
    return (
        f'<div class="pg-progress"><div class="pg-bar"><div class="pg-bar-fill pg-decode" '
        f'style="width:{pct:.1f}%"></div></div><span>{done} / {total} requests done · '
        f"{elapsed_s:.1f} s elapsed{(' · ' + note) if note else ''}</span></div>"
    )
