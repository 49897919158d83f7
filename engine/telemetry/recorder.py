"""StepRecorder: everything the engine records about its steps and finished requests.

Per step a StepStats (ring buffer + metrics sink), per finished request a FinishedRequest, and
the running totals behind EngineStats (steps, prefix-cache lookups, draft tokens). It owns those
counters; the scheduler owns only its preemption count. The metrics sink is any object with the
observe_* methods (MetricsSink): the engine's callers pass a Prometheus registry where they want
one (engine/telemetry/prom.py), else the engine keeps the null one. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.request import RequestMetrics
from engine.telemetry.cost import ModelShape, StepCost, step_cost
from engine.telemetry.stats import FinishedRequest, RingBuffer, StepStats, step_kind

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler, SchedulerOutput


class MetricsSink(Protocol):
    """Where step and request records go besides the ring buffers (e.g. Prometheus)."""

    def observe_step(self, step: StepStats) -> None: ...
    def observe_finished(self, metrics: RequestMetrics, finish_reason: str) -> None: ...
    def observe_prefix_cache(self, num_query_tokens: int, num_hit_tokens: int) -> None: ...
    def observe_spec_decode(
        self, num_draft_tokens: int, num_accepted_tokens: int, num_drafts: int = 0,
        accepted_by_position: Sequence[int] = (),
    ) -> None: ...  # fmt: skip
    def observe_step_failure(self) -> None: ...


@dataclass(frozen=True)
class StepStart:
    """What a step is about to compute, read before Scheduler.update() advances its requests
    (the context lengths and the decode/prefill split depend on num_computed_tokens)."""

    start_time: float  # time.perf_counter() seconds when the step began
    cost: StepCost  # estimated FLOPs and bytes of the step
    num_decode_reqs: int  # requests generating (the rest compute prompt tokens)


class StepRecorder:
    def __init__(
        self,
        shape: ModelShape,
        scheduler: Scheduler,
        block_manager: BlockManager,
        metrics: MetricsSink,
        *,
        step_history_len: int,
        request_history_len: int,
        draft_shape: ModelShape | None = None,
    ) -> None:
        self.shape = shape
        self.draft_shape = draft_shape  # speculative_method="draft": the draft model's
        self.scheduler = scheduler  # read only: queue lengths after each step
        self.block_manager = block_manager  # read only: block counts after each step
        self.metrics = metrics
        self.step_history: RingBuffer[StepStats] = RingBuffer(step_history_len)
        self.finished_history: RingBuffer[FinishedRequest] = RingBuffer(request_history_len)
        self.num_steps = 0  # steps recorded since start-up
        # Prefix cache, over all admissions: prompt tokens looked up / found cached.
        self.num_prefix_query_tokens_total = 0
        self.num_prefix_hit_tokens_total = 0
        # Speculative decoding: draft tokens verified / accepted.
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self.num_spec_proposals_total = 0  # request-steps that verified drafts
        self.num_draft_tokens_by_position: list[int] = []  # index i: drafts at position i
        self.num_accepted_tokens_by_position: list[int] = []  # ... of those, accepted
        # Steps whose forward pass raised (their requests were failed; not in num_steps).
        self.num_step_failures_total = 0

    def start_step(self, sched: SchedulerOutput, start_time: float) -> StepStart:
        """Take the step's shape; call between schedule() and update()."""
        scheduled = sched.scheduled
        num_new = [s.num_new_tokens for s in scheduled]
        context = [s.request.num_computed_tokens + s.num_new_tokens for s in scheduled]
        num_logits = sum(s.samples + s.num_draft_tokens for s in scheduled)
        return StepStart(
            start_time=start_time,
            cost=step_cost(self.shape, num_new, context, num_logits),
            num_decode_reqs=sum(s.is_decode for s in scheduled),
        )

    def record_step(
        self,
        start: StepStart,
        sched: SchedulerOutput,
        sampled: Mapping[str, list[int]],
        end_time: float,
        draft_time_s: float = 0.0,
        execute_time_s: float = 0.0,
        draft_passes: Sequence[tuple[list[int], list[int], int]] = (),
    ) -> StepStats:
        """Record a finished step: its StepStats, and the prefix and draft totals.
        `draft_time_s` is the draft model's share of `execute_time_s` (the runner's)."""
        num_drafts = sum(s.num_draft_tokens for s in sched.scheduled)
        # Drafts accepted: each verifying request appended its accepted drafts plus one token.
        accepted = [
            (s.num_draft_tokens, max(0, len(sampled.get(s.request.request_id, ())) - 1))
            for s in sched.scheduled
            if s.num_draft_tokens
        ]
        num_accepted = sum(a for _, a in accepted)
        by_position = self._count_by_position(accepted)
        timing = (draft_time_s, execute_time_s - draft_time_s if num_drafts else 0.0)
        stats = self._step_stats(
            start, sched, end_time, num_drafts, num_accepted, len(accepted), timing
        )
        if draft_passes and self.draft_shape is not None:
            costs = [step_cost(self.draft_shape, *p) for p in draft_passes]
            stats = dataclasses.replace(
                stats,
                draft_flops=sum(c.flops for c in costs),
                draft_bytes_moved=sum(c.bytes_moved for c in costs),
            )
        if num_drafts:
            self.num_draft_tokens_total += num_drafts
            self.num_accepted_tokens_total += num_accepted
            self.num_spec_proposals_total += len(accepted)
            self.metrics.observe_spec_decode(
                num_drafts, num_accepted, num_drafts=len(accepted), accepted_by_position=by_position
            )
        if sched.num_prefix_query_tokens:
            self.num_prefix_query_tokens_total += sched.num_prefix_query_tokens
            self.num_prefix_hit_tokens_total += sched.num_prefix_hit_tokens
            self.metrics.observe_prefix_cache(
                sched.num_prefix_query_tokens, sched.num_prefix_hit_tokens
            )
        self.num_steps += 1
        self.step_history.append(stats)
        self.metrics.observe_step(stats)
        return stats

    def _count_by_position(self, accepted: list[tuple[int, int]]) -> list[int]:
        """Add (drafts, accepted) per verifying request to the per-position totals; returns
        this step's accepted count per position. Draft i is accepted only if all before it
        were, so a request with a accepted counts at positions 0 .. a - 1."""
        width = max((n for n, _ in accepted), default=0)
        for totals in (self.num_draft_tokens_by_position, self.num_accepted_tokens_by_position):
            totals.extend([0] * (width - len(totals)))
        step = [0] * width
        for num_drafts, num_accepted in accepted:
            for i in range(num_drafts):
                self.num_draft_tokens_by_position[i] += 1
            for i in range(min(num_accepted, num_drafts)):
                self.num_accepted_tokens_by_position[i] += 1
                step[i] += 1
        return step

    def record_step_failure(self) -> None:
        """Count a step whose forward pass raised. It gets no StepStats: it computed nothing
        that stayed (its requests were failed and their blocks freed)."""
        self.num_step_failures_total += 1
        self.metrics.observe_step_failure()

    def record_finished(self, request_id: str, finish_reason: str, metrics: RequestMetrics) -> None:
        self.finished_history.append(FinishedRequest(request_id, finish_reason, metrics))
        self.metrics.observe_finished(metrics, finish_reason)

    def _step_stats(
        self, start: StepStart, sched: SchedulerOutput, end_time: float,
        num_drafts: int, num_accepted: int, num_proposals: int, timing: tuple[float, float],
    ) -> StepStats:  # fmt: skip
        bm = self.block_manager
        batch_size = len(sched.scheduled)
        return StepStats(
            step_index=self.num_steps,
            start_time=start.start_time,
            duration_s=end_time - start.start_time,
            kind=step_kind(sched.num_prefill_tokens, sched.num_decode_tokens),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_prefill_reqs=batch_size - start.num_decode_reqs,
            num_decode_reqs=start.num_decode_reqs,
            batch_size=batch_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=len(sched.preempted_ids),
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_kv_blocks=bm.num_blocks,
            flops=start.cost.flops,
            bytes_moved=start.cost.bytes_moved,
            num_blocks_cached=bm.num_cached_blocks if bm.enable_prefix_caching else 0,
            num_prefix_query_tokens=sched.num_prefix_query_tokens,
            num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
            num_block_copies=len(sched.block_copies),
            draft_duration_s=timing[0],
            verify_duration_s=timing[1],
            num_spec_proposals=num_proposals,
        )
