"""Engine (live) logic: one snapshot of the running engine turned into the tab's views.

Cheap by construction: stats() is lock-free; block_snapshot() and queue_snapshot() take the
engine lock between steps for a copy of a few lists. When nothing changed since the last tick
the tab skips re-sending figures, so an idle engine costs the browser nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from engine.telemetry.stats import EngineStats
from playground.engine_client import EngineClient
from playground.figures.blocks import block_map_figure, usage_gauge
from playground.figures.engine import batch_timeline_figure, queue_html
from playground.figures.style import fmt_bytes


@dataclass
class LiveView:
    summary_md: str
    block_map: go.Figure
    gauge: go.Figure
    queue_html: str
    timeline: go.Figure


def signature(stats: EngineStats) -> tuple[int, ...]:
    """Changes whenever anything on the tab could: a step ran, a request came or went."""
    return (
        stats.num_steps_total,
        stats.num_free_kv_blocks,
        stats.num_running,
        stats.num_waiting,
        len(stats.finished),
    )


def summary_markdown(stats: EngineStats, num_used_blocks: int) -> str:
    pct = 100.0 * num_used_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
    last = stats.steps[-1] if stats.steps else None
    step = (
        f"last step: {last.kind}, {last.batch_size} requests, {last.num_tokens} tokens, "
        f"{last.duration_s * 1e3:.1f} ms"
        if last
        else "no step yet: send a message in Chat or run a load test"
    )
    return (
        f"**KV blocks used: {num_used_blocks} / {stats.num_kv_blocks}** ({pct:.1f} %, "
        f"{stats.block_size} tokens per block, pool {fmt_bytes(stats.kv_cache_bytes)}) · "
        f"running **{stats.num_running}** · waiting **{stats.num_waiting}** · "
        f"steps {stats.num_steps_total} · preemptions {stats.num_preemptions_total} · "
        f"{prefix_cache_text(stats)}{spec_decode_text(stats)}{step}"
    )


def spec_decode_text(stats: EngineStats) -> str:
    """Draft tokens accepted so far ("" until a draft was verified, i.e. when it is off)."""
    if not stats.num_draft_tokens_total:
        return ""
    return (
        f"speculative: {stats.num_accepted_tokens_total:,} of "
        f"{stats.num_draft_tokens_total:,} draft tokens accepted "
        f"({100 * stats.draft_acceptance_rate:.0f} %) · "
    )


def prefix_cache_text(stats: EngineStats) -> str:
    """Prefix-cache hits so far ("" until a prompt was looked up, i.e. when caching is off)."""
    if not stats.num_prefix_query_tokens_total:
        return ""
    return (
        f"prefix cache: {stats.num_prefix_hit_tokens_total:,} of "
        f"{stats.num_prefix_query_tokens_total:,} prompt tokens hit "
        f"({100 * stats.prefix_cache_hit_rate:.0f} %), {stats.num_cached_kv_blocks} blocks "
        f"cached, {stats.num_prefix_evictions_total} evicted · "
    )


def live_view(service: EngineClient) -> tuple[tuple[int, ...], LiveView]:
    stats = service.stats()
    snapshot = service.block_snapshot()
    queue = service.queue_snapshot()
    used = snapshot.num_blocks - snapshot.num_free
    view = LiveView(
        summary_md=summary_markdown(stats, used),
        block_map=block_map_figure(snapshot),
        gauge=usage_gauge(used, snapshot.num_blocks),
        queue_html=queue_html(queue),
        timeline=batch_timeline_figure(stats.steps),
    )
    return signature(stats), view
