"""Compare in remote mode: the same seeded requests against two OpenAI-compatible servers, one
after the other: A is the server the playground points at, B another base URL (vLLM on another
port, our server with another config, ...). Only what a client measures is compared: latencies
and throughput, not engine steps or block maps.

Both servers must serve the same model: the prompts are token ids from A's tokenizer chain.
Server-side caching decides TTFT, so each side's is named; when B is the same server as A, B's
prompts are salted (a different first token) so they cannot hit the cache A's run just filled.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from playground.handlers.compare import COMPARE_ROWS, SideOutcome, compare_rows
from playground.handlers.loadtest import BackgroundRun
from playground.loadgen import GenRequest, OpenAITarget, Target
from playground.loadgen.workload import vocabulary_ids
from playground.remote.client import RemoteServer, server_root
from playground.remote.tokenizer import PromptTokenizer

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}

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


def _host_port(base_url: str) -> tuple[str, int | None, str]:
    parts = urlsplit(server_root(base_url))
    host = parts.hostname or ""
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return ("loopback" if host in _LOOPBACK else host, port, parts.path.rstrip("/"))


def same_server(a: RemoteServer, b: RemoteServer) -> bool:
    """Both base URLs reach one server (localhost and 127.0.0.1 count as the same host)."""
    return _host_port(a.base_url) == _host_port(b.base_url)


def salt_token_id(requests: list[GenRequest], prompts: PromptTokenizer) -> int | None:
    """A token id that starts none of the requests' prompts (None: text prompts, or no id
    left): B's prompts start with it instead, so none equals a prompt A sent."""
    firsts = {r.prompt[0] for r in requests if isinstance(r.prompt, list) and r.prompt}
    if not firsts:
        return None
    return next((int(i) for i in vocabulary_ids(prompts.tokenizer) if i not in firsts), None)


def targets_for(
    a: RemoteServer, b: RemoteServer, prompts: PromptTokenizer, requests: list[GenRequest]
) -> tuple[OpenAITarget, OpenAITarget, str]:
    """A's and B's targets, and a warning for the status ("" when the servers differ)."""
    salt = salt_token_id(requests, prompts) if same_server(a, b) else None
    warning = ""
    if same_server(a, b):
        warning = (
            "\n\n**Same server on both sides:** B runs right after A on the server A just "
            "warmed, so B could be served from A's prompt/prefix cache; "
            + (
                f"B's prompts are salted (first token id {salt}), lengths unchanged."
                if salt is not None
                else "its prompts could not be salted, so read B's TTFT with care."
            )
        )
    return (
        OpenAITarget.for_server(a, prompts),
        OpenAITarget.for_server(b, prompts, salt_token_id=salt),
        warning,
    )


def caching_markdown(sides: list[RemoteSide]) -> str:
    """Each side's server-side caching, for the status."""
    lines = [f"{s.name}: {s.target.notes['caching']}" for s in sides]
    return "\n\n**Caching:** " + "; ".join(lines) + "."


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
