"""Compare in remote mode: the same seeded requests against two OpenAI-compatible servers, one
after the other: A is the server the playground points at, B another base URL (vLLM on another
port, our server with another config, ...). Only what a client measures is compared: latencies
and throughput, not engine steps or block maps.

Both servers must serve the same model: the prompts are token ids from A's tokenizer.
"""

from __future__ import annotations

from playground.handlers.compare import COMPARE_ROWS, SideOutcome, compare_rows
from playground.handlers.loadtest import BackgroundRun
from playground.loadgen import OpenAITarget, Target
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


def connect_side(
    name: str, base_url: str | None, model: str | None, api_key: str | None
) -> RemoteServer:
    """The server of one side (GET /v1/models); ValueError names the side."""
    if not (base_url or "").strip():
        raise ValueError(f"{name} base URL: give the server's URL, e.g. http://127.0.0.1:8001")
    try:
        return RemoteServer.connect(base_url, api_key or None, (model or "").strip() or None)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None


def target_for(server: RemoteServer, tokenizer: Tokenizer) -> OpenAITarget:
    return OpenAITarget(server.base_url, server.model, server.api_key, tokenizer=tokenizer)


class RemoteSide:
    """A CompareSide that is a server already running: nothing to start or shut down, no block
    map to poll; only what the client measures."""

    config = None
    starting = "connecting"
    finishing = "done"

    def __init__(self, name: str, label: str, target: OpenAITarget) -> None:
        self.name = name
        self.label = label
        self.target = target

    def start(self) -> Target:
        return self.target

    def finish(self, outcome: SideOutcome, run: BackgroundRun | None) -> None:
        pass


def remote_compare_rows(a: SideOutcome, b: SideOutcome) -> list[list[str]]:
    return compare_rows(a, b, CLIENT_ROWS)
