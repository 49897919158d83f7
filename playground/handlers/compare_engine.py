"""Compare sides that are engines: two engine configurations, each in its own EngineService,
run on the same seeded requests; the block map kept at each side's peak usage.

The same code serves both sides (docs/architecture.md: baselines live in the same engine): only the
EngineConfig fields in SIDE_FIELDS differ, and the KV budget is fixed in tokens so a bigger
block size gets fewer blocks of the same total bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockSnapshot
from playground.engine_client import EngineClient
from playground.handlers.compare import SideOutcome, blocks_held
from playground.handlers.loadtest import BackgroundRun
from playground.loadgen import EngineTarget, Target

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

    def __init__(self, service: EngineClient, interval_s: float = 0.1) -> None:
        self.service = service
        self.interval_s = interval_s
        self.peak: BlockSnapshot = service.block_snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-poller", daemon=True)

    def start(self) -> PeakPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            snap = self.service.block_snapshot()
            if blocks_held(snap) > blocks_held(self.peak):
                self.peak = snap

    def stop(self) -> BlockSnapshot:
        self._stop.set()
        self._thread.join()
        return self.peak


class EngineSide:
    """A CompareSide that builds an engine with its config, polls its block map while the
    load test runs, keeps the run's steps and shuts the engine down."""

    starting = "loading the model"
    finishing = "shutting down"

    def __init__(
        self,
        name: str,
        label: str,
        config: EngineConfig,
        make_service: Callable[[EngineConfig], EngineClient],
    ) -> None:
        self.name = name
        self.label = label
        self.config = config
        self.make_service = make_service
        self._service: EngineClient | None = None
        self._poller: PeakPoller | None = None

    def start(self) -> Target:
        try:
            self._service = self.make_service(self.config)
        except Exception as e:  # a config the engine refuses: the compare reports it, goes on
            raise RuntimeError(f"engine did not start: {e}") from e
        try:
            self._poller = PeakPoller(self._service).start()
        except BaseException:
            self._shutdown()
            raise
        return EngineTarget(self._service)

    def finish(self, outcome: SideOutcome, run: BackgroundRun | None) -> None:
        try:
            if run is not None and run.done.is_set():
                steps = self._service.stats().steps
                outcome.steps = [s for s in steps if s.start_time >= run.start_time]
        finally:
            if self._poller is not None:
                outcome.peak = self._poller.stop()
                self._poller = None
            self._shutdown()

    def _shutdown(self) -> None:
        if self._service is not None:
            service, self._service = self._service, None
            service.shutdown()


def engine_sides(
    sides: list[tuple[str, str, EngineConfig]],
    make_service: Callable[[EngineConfig], EngineClient],
) -> list[EngineSide]:
    """(name, label, config) per side -> the CompareSides BackgroundCompare runs."""
    return [EngineSide(name, label, config, make_service) for name, label, config in sides]
