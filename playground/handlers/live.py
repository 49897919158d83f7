"""Engine (live) logic: one snapshot of the running engine turned into the tab's views.

Cheap by construction: stats() is lock-free; block_snapshot() and queue_snapshot() take the
engine lock between steps for a copy of a few lists. When nothing changed since the last tick
the block map, gauge, queue and summary are neither built nor sent; the timeline (at most
NUM_TIME_BINS bars) is re-sent while it has steps in its window, since "seconds ago" moves. An
idle engine costs the browser nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import plotly.graph_objects as go

from engine.telemetry.stats import EngineStats
from playground.engine_client import EngineClient
from playground.engine_info import kv_format
from playground.figures.blocks import block_map_figure, usage_gauge
from playground.figures.engine import (
    TIMELINE_WINDOWS_S,
    acceptance_figure,
    batch_timeline_figure,
    queue_html,
)
from playground.figures.style import fmt_bytes, plural


@dataclass
class LiveView:
    """The tab's views; None where nothing changed since the signature the caller last drew."""

    summary_md: str | None
    block_map: go.Figure | None
    gauge: go.Figure | None
    queue_html: str | None
    timeline: go.Figure | None
    # Draft acceptance by position; None also when speculative decoding is off (not shown).
    acceptance: go.Figure | None = None


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
        f"last step: {last.kind}, {plural(last.batch_size, 'request')}, "
        f"{plural(last.num_tokens, 'token')}, "
        f"{last.duration_s * 1e3:.1f} ms"
        if last
        else "no step yet: send a message in Chat or run a load test"
    )
    return (
        f"**KV blocks used: {num_used_blocks} / {stats.num_kv_blocks}** ({pct:.1f} %, "
        f"{stats.block_size} tokens per block, pool {fmt_bytes(stats.kv_cache_bytes)}"
        f"{kv_format_suffix(stats)}{draft_kv_suffix(stats)}) · "
        f"running **{stats.num_running}** · waiting **{stats.num_waiting}** · "
        f"steps {stats.num_steps_total} · preemptions {stats.num_preemptions_total} · "
        f"{prefix_cache_text(stats)}{spec_decode_text(stats)}{step}"
    )


def kv_format_suffix(stats: EngineStats) -> str:
    """' of int8 K/V + ...' after the pool size ("" when the engine did not say)."""
    text = kv_format(stats.kv_cache_dtype)
    return f" of {text}" if text else ""


def draft_kv_suffix(stats: EngineStats) -> str:
    """' + the draft model's K/V' (speculative_method="draft": it shares the blocks)."""
    if not stats.draft_kv_cache_bytes:
        return ""
    return f", + {fmt_bytes(stats.draft_kv_cache_bytes)} of draft-model K/V in the same blocks"


def spec_decode_text(stats: EngineStats) -> str:
    """Draft tokens accepted so far ("" until a draft was verified, i.e. when it is off), with
    the mean accepted length and the acceptance at each draft position when known."""
    if not stats.num_draft_tokens_total:
        return ""
    detail = ""
    if stats.num_spec_proposals_total:
        by_position = " / ".join(f"{100 * r:.0f}" for r in stats.acceptance_by_position)
        detail = (
            f", {stats.mean_accepted_length:.2f} tokens per verify, by position {by_position} %"
        )
    return (
        f"speculative: {stats.num_accepted_tokens_total:,} of "
        f"{stats.num_draft_tokens_total:,} draft tokens accepted "
        f"({100 * stats.draft_acceptance_rate:.0f} %{detail}) · "
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


def timeline_moving(stats: EngineStats, now_s: float, window_s: float) -> bool:
    """Whether the timeline shows a step: its "seconds ago" axis then moves every tick."""
    return bool(stats.steps) and now_s - stats.steps[-1].start_time <= window_s


def live_view(
    service: EngineClient,
    window_s: float = TIMELINE_WINDOWS_S["last 2 min"],
    last_signature: tuple[int, ...] | None = None,
    speculative: bool = False,
) -> tuple[tuple[int, ...], LiveView]:
    """The views of the engine now. With last_signature: only what changed since (the block
    map of a 100k-block pool is not rebuilt or re-sent while nothing happens). speculative:
    the engine drafts (speculative_method != "off"), so the acceptance chart is drawn."""
    stats = service.stats()
    now_s = time.perf_counter()  # the clock of StepStats.start_time
    sig = signature(stats)
    changed = sig != last_signature
    moving = timeline_moving(stats, now_s, window_s)
    timeline = batch_timeline_figure(stats.steps, now_s, window_s) if changed or moving else None
    if not changed:
        return sig, LiveView(None, None, None, None, timeline)
    snapshot = service.block_snapshot()
    queue = service.queue_snapshot()
    used = snapshot.num_blocks - snapshot.num_free
    view = LiveView(
        summary_md=summary_markdown(stats, used),
        block_map=block_map_figure(snapshot),
        gauge=usage_gauge(used, snapshot.num_blocks),
        queue_html=queue_html(queue),
        timeline=timeline,
        acceptance=acceptance_figure(stats) if speculative else None,
    )
    return sig, view
