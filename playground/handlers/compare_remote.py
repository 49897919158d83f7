"""Compare in remote mode: the same seeded requests against two OpenAI-compatible servers, one
after the other: A is the server the playground points at, B another base URL (vLLM on another
port, our server with another config, ...). Only what a client measures is compared: latencies
and throughput, not engine steps or block maps.

Both servers must serve the same model: the prompts are token ids from A's tokenizer.
"""

from __future__ import annotations

from typing import Any

from playground.handlers.compare import COMPARE_ROWS, BackgroundCompare, SideOutcome, compare_rows
from playground.handlers.loadtest import BackgroundRun
from playground.loadgen import GenRequest, OpenAITarget, WorkloadSpec
from playground.loadgen.workload import Tokenizer
from playground.remote.client import RemoteServer

# The rows a client can fill: everything up to the engine's own counters (steps, blocks, ...).
CLIENT_KEYS = frozenset(
    {
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
    }
)
CLIENT_ROWS = tuple(row for row in COMPARE_ROWS if row[1] in CLIENT_KEYS)


def connect_side(name: str, base_url: Any, model: Any, api_key: Any) -> RemoteServer:
    """The server of one side (GET /v1/models); ValueError names the side."""
    if not (base_url or "").strip():
        raise ValueError(f"{name} base URL: give the server's URL, e.g. http://127.0.0.1:8001")
    try:
        return RemoteServer.connect(base_url, api_key or None, (model or "").strip() or None)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None


def target_for(server: RemoteServer, tokenizer: Tokenizer) -> OpenAITarget:
    return OpenAITarget(server.base_url, server.model, server.api_key, tokenizer=tokenizer)


def _no_engine(config: Any) -> Any:
    raise RuntimeError("a remote compare starts no engine")


class RemoteCompare(BackgroundCompare):
    """BackgroundCompare over two OpenAI targets: each side is a load test, nothing to start
    or shut down, no block map to poll."""

    def __init__(
        self,
        spec: WorkloadSpec,
        sides: list[tuple[str, str, OpenAITarget]],
        requests: list[GenRequest],
    ) -> None:
        super().__init__(spec, [(n, label, None) for n, label, _ in sides], requests, _no_engine)
        self.targets = {name: target for name, _, target in sides}

    def _run_side(self, outcome: SideOutcome) -> None:
        self.phase = f"{outcome.label}: running"
        run = BackgroundRun(self.spec, self.targets[outcome.name], self.requests)
        self.current = run
        if self._stopped:  # stopped between the sides
            run.stop()
        run.start().done.wait()
        outcome.result, outcome.error = run.result, run.error
        self.current = None


def remote_compare_rows(a: SideOutcome, b: SideOutcome) -> list[list[str]]:
    return compare_rows(a, b, CLIENT_ROWS)
