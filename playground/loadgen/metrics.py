"""Load-test results and the serving metrics computed from them, with the field's definitions
(as `vllm bench serve` computes them):

  TTFT  time to first token: request sent -> first chunk/delta carrying output text or tokens.
  ITL   inter-token latency: gaps between consecutive content chunks, pooled over requests.
  TPOT  time per output token, per request: (E2E - TTFT) / (output tokens - 1); requests with
        one output token have none (and count as meeting a TPOT SLO, as in vLLM).
  E2E   end-to-end latency: request sent -> last byte of the response.
  goodput  requests/s that met every given SLO (ttft / tpot / e2el, in ms).
Output tokens come from the server's usage report, not from counting chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from playground.loadgen.workload import WorkloadSpec

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 99)


@dataclass
class RequestResult:
    """One request's timeline. Times are time.perf_counter() seconds."""

    index: int
    send_time: float
    first_token_time: float | None = None
    end_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    finish_reason: str | None = None
    queue_s: float | None = None  # engine target only: RequestMetrics.queue_s
    # Engine target only: the output token ids (Compare's greedy agreement between sides).
    output_token_ids: list[int] | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e_s(self) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot_s(self) -> float | None:
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        """Times relative to t0 (the test's start), derived latencies included."""

        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        return {
            "index": self.index,
            "send_time_s": rel(self.send_time),
            "first_token_time_s": rel(self.first_token_time),
            "end_time_s": rel(self.end_time),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "queue_s": self.queue_s,
            "itl_s": self.itl_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos_ms: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            slos_ms[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r} has no number of milliseconds") from None
        if not slos_ms[name] > 0:
            raise ValueError(f"goodput: {item!r} must be > 0 ms")
    return slos_ms


def meets_slos(result: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """A successful request meets the SLOs when every given metric is at most its bound."""
    if not result.success:
        return False
    values_s = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.e2e_s}
    for name, bound_ms in slos_ms.items():
        value_s = values_s[name]
        if value_s is None or value_s * 1000.0 > bound_ms:
            return False
    return True


def _stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / p90 / p99 in milliseconds; None when there is no value."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{p}_{name}_ms" for p in PERCENTILES]
    if len(values_s) == 0:
        return dict.fromkeys(keys, None)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    stats = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in PERCENTILES]
    return {k: float(v) for k, v in zip(keys, stats, strict=True)}


def compute_summary(
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """vllm-bench-like summary of a run that lasted duration_s seconds."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "goodput": None,
        "good_requests": None,
        "slos_ms": dict(slos_ms or {}),
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        summary["good_requests"] = good
        summary["goodput"] = per_s(good)
    summary |= _stats_ms("ttft", [r.ttft_s for r in ok if r.ttft_s is not None])
    summary |= _stats_ms("tpot", [r.tpot_s for r in ok if r.tpot_s is not None])
    summary |= _stats_ms("itl", [gap for r in ok for gap in r.itl_s])
    summary |= _stats_ms("e2el", [r.e2e_s for r in ok if r.e2e_s is not None])
    queue = [r.queue_s for r in ok if r.queue_s is not None]
    if queue:
        summary |= _stats_ms("queue", queue)
    summary["errors"] = dict(Counter((r.error or "unfinished")[:200] for r in failed))
    return summary


@dataclass
class LoadTestResult:
    spec: WorkloadSpec
    target: str  # what was measured, e.g. "engine:smollm2-135m" or "http://host:8000 (model)"
    start_time: float  # perf_counter s when the measured run began
    end_time: float
    per_request: list[RequestResult]
    slos_ms: dict[str, float] = field(default_factory=dict)
    # What a reader must know to compare results: server-side caching, how prompts were built.
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_time - self.start_time

    def summary(self, slos_ms: Mapping[str, float] | None = None) -> dict[str, Any]:
        return compute_summary(
            self.per_request, self.duration_s, self.slos_ms if slos_ms is None else slos_ms
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "spec": self.spec.to_dict(),
            "summary": self.summary(),
            "notes": self.notes,
            "per_request": [r.to_dict(self.start_time) for r in self.per_request],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def format_table(self) -> str:
        return format_summary_table(self.summary())


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)  # type: ignore[arg-type]
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
    ("queue", "Engine Queue Time", "queue"),
)


def format_summary_table(s: Mapping[str, Any]) -> str:
    """The summary as `vllm bench serve` prints it."""

    def row(label: str, value: Any) -> str:
        if value is None:
            return f"{label:<40} {'n/a':<10}"
        if isinstance(value, float):
            return f"{label:<40} {value:<10.2f}"
        return f"{label:<40} {value:<10}"

    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", s["completed"]),
        row("Failed requests:", s["failed"]),
        row("Benchmark duration (s):", s["duration_s"]),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput"]),
    ]
    if s.get("goodput") is not None:
        lines.append(row("Request goodput (req/s):", s["goodput"]))
    lines += [
        row("Output token throughput (tok/s):", s["output_throughput"]),
        row("Total Token throughput (tok/s):", s["total_token_throughput"]),
    ]
    for key, title, short in _SECTIONS:
        if f"mean_{key}_ms" not in s:
            continue
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", s[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", s[f"median_{key}_ms"]))
        for p in PERCENTILES:
            lines.append(row(f"P{p} {short} (ms):", s[f"p{p}_{key}_ms"]))
    for reason, count in (s.get("errors") or {}).items():
        lines.append(f"failed x{count}: {reason}")
    lines.append("=" * 50)
    return "\n".join(lines)
