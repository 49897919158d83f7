"""Continuous batching in the vLLM v1 style: no prefill/decode phases, one token budget.

Each request has `num_computed_tokens` (K/V already in the cache) and `num_tokens` (prompt +
output). A step gives each chosen request `num_new_tokens` of work: a whole or chunked prefill,
or one decode token. Running requests go first (FCFS); when blocks run out the newest running
request is preempted (blocks freed, put back at the front of the waiting queue, recomputed
later). Waiting requests are admitted while the budget, the sequence cap and the blocks allow;
with prefix caching an admitted request first shares its longest cached prefix of full blocks
(BlockManager.lookup_prefix) and starts computing after it.

Parallel sampling (SamplingParams.n > 1): the group's sequence 0 computes the prompt but its
last token; then the others fork off it (`_fork_if_ready`), sharing its blocks, and each
computes the last prompt token itself and samples from there with its own generator. A block
about to be written while others share it is copied first (copy-on-write;
`SchedulerOutput.block_copies`).
A group is preempted as a unit, by recompute: every running sequence of it frees its blocks
and re-enters the waiting queue; readmitted, each recomputes its own prompt + output (sharing
again only what the prefix cache holds). With `enable_prompt_sharing=False` (the baseline)
the n sequences enter the queue as n separate requests: each computes the whole prompt into
its own blocks; no fork, no copy-on-write.

`batching="static"` is the pre-Orca baseline: a batch is admitted only when the previous one
has completely finished, so no request joins a running batch and early finishers leave holes.

The scheduler never touches tensors: it hands the model runner block ids in `SchedulerOutput`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.request import Request, RequestStatus, TokenLogprob


@dataclass
class ScheduledRequest:
    """One request's work in a step. Built by the scheduler, read by the model runner, the
    scheduler's update() and the step recorder; nobody changes it after schedule()."""

    request: Request  # the engine's request (tokens, params, num_computed_tokens)
    # Tokens to compute this step, from request.num_computed_tokens; drafts included.
    num_new_tokens: int
    block_table: list[int]  # the request's KV blocks (a live view, not a copy)
    # Speculative tokens guessed to follow the request's last token, fed after it and
    # verified by this step: the proposer's draft cut to the step's token budget.
    draft_token_ids: list[int] = field(default_factory=list)
    # speculative_method="draft": positions reserved after the last token that the runner's
    # draft model fills in this step (its tokens exist only once the step runs).
    num_draft_slots: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled.
        (Read before update() advances the request.)"""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens >= req.num_tokens

    @property
    def is_decode(self) -> bool:
        """Generating (drafts included), as opposed to computing the prompt: a prompt's last
        1-token chunk is still prefill. (Read before update() advances the request.)"""
        req = self.request
        return req.num_output_tokens > 0 and req.num_computed_tokens + 1 >= req.num_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Speculative tokens scheduled past the known ones (verified by this step)."""
        return len(self.draft_token_ids) + self.num_draft_slots


@dataclass
class SchedulerOutput:
    """What one step computes: the scheduler's single message to the model runner."""

    # Requests with work this step: running ones oldest first, then newly admitted ones.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # preempted during this step
    num_prefill_tokens: int = 0  # tokens of requests with more than one new token
    num_decode_tokens: int = 0  # tokens of requests in decode (speculative tokens included)
    # Prefix cache, for requests admitted this step: tokens looked up, tokens found cached.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Copy-on-write: (source block, destination block) pairs the runner copies (all layers,
    # K and V) before the forward pass, so a sequence writes into a private copy.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batching: str = "continuous",
        enable_chunked_prefill: bool = True,
        enable_prompt_sharing: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static = batching == "static"
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_prompt_sharing = enable_prompt_sharing
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0

    # --- queue management ---
    def add_request(self, request: Request) -> None:
        """Queue a request; with n > 1 its samples ride along until they fork off it, or,
        without prompt sharing, queue right behind it as requests of their own (each one
        computes the whole prompt; they still answer to the group's id and seeds)."""
        if not self.enable_prompt_sharing:
            samples, request.pending_samples = request.pending_samples, []
            self.waiting.extend([request, *samples])
            return
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
                    return request
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running request early (the engine calls this when a stop string matched)."""
        if request in self.running:
            self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.metrics.finish_time = time.perf_counter()
        self.block_manager.free(request.request_id)

    # --- one step ---
    def schedule(self, drafts: Mapping[str, list[int] | int] | None = None) -> SchedulerOutput:
        """Pick this step's work. `drafts` maps request ids to speculative tokens (n-gram
        proposer) or to a number of slots the runner's draft model fills (draft method); a
        decoding request verifies as many of them as the budget leaves."""
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.static and not self.running:
            self._admit_static_batch(out)

        # 1) Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            draft: list[int] = []
            slots = 0
            proposal = drafts.get(request.request_id) if num_new == 1 else None
            if isinstance(proposal, int):
                slots = max(0, min(proposal, budget - 1))
            elif proposal:
                draft = proposal[: budget - 1]
            num_new += len(draft) + slots  # decode: verify the draft too
            target = request.num_computed_tokens + num_new
            num_preempted = len(out.preempted_ids)
            if not self._reserve(request, target, out):
                break  # the request preempted itself; nothing after it can run either
            self._add(out, request, num_new, draft, slots)
            budget -= num_new
            if len(out.preempted_ids) == num_preempted:
                i += 1
            else:  # a preempted group may have had members before this request
                i = self.running.index(request) + 1

        # 2) Waiting requests (continuous only), unless this step had to preempt: the blocks
        #    are too scarce to take on more work.
        if not self.static and not out.preempted_ids:
            bm = self.block_manager
            while self.waiting and budget > 0 and self._has_room_for(self.waiting[0]):
                request = self.waiting[0]
                # Fresh (or preempted) requests start from their longest cached prefix.
                prefix = self._cached_prefix(request)
                cached_tokens = len(prefix) * bm.block_size
                num_new = self._num_new_tokens(request, budget, skip=cached_tokens)
                if num_new == 0 and not request.pending_samples:
                    break
                target = request.num_computed_tokens + cached_tokens + num_new
                if not bm.can_allocate(request.request_id, target, prefix):
                    break
                self.waiting.popleft()
                if bm.enable_prefix_caching:
                    self._start_from_prefix(request, prefix, out)
                bm.allocate(request.request_id, target)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if num_new == 0:  # n > 1 with nothing before the fork point: fork now
                    budget = self._fork_at_admission(request, budget, out)
                    continue
                self._add(out, request, num_new)
                budget -= num_new
        return out

    def _fork_at_admission(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Fork a group whose prompt is all cached but the last token (or one token long)
        and schedule each sequence's last prompt token in this step, as far as the budget
        and the blocks go (the rest run next step). Returns the budget left."""
        samples = list(request.pending_samples)
        self._fork_if_ready(request)
        for sequence in [request, *samples]:
            num_new = self._num_new_tokens(sequence, budget)
            target = sequence.num_computed_tokens + num_new
            if (
                num_new == 0
                or self._blocks_to_write(sequence, target) > self.block_manager.num_free_blocks
            ):
                break
            self._allocate(sequence, target, out)
            self._add(out, sequence, num_new)
            budget -= num_new
        return budget

    def _num_seqs(self) -> int:
        """Sequences running, counting the samples of a group not forked yet."""
        return sum(1 + len(r.pending_samples) for r in self.running)

    def _has_room_for(self, request: Request) -> bool:
        """max_num_seqs holds with the request and its samples to come (n at once)."""
        return self._num_seqs() + 1 + len(request.pending_samples) <= self.max_num_seqs

    def _fork_if_ready(self, request: Request) -> None:
        """Parallel sampling: once the group's sequence 0 has computed every prompt token but
        the last, the other n - 1 sequences fork off it (sharing all its blocks, the partly
        filled last one included) and run beside it from the next step."""
        if not request.pending_samples or request.num_computed_tokens < request.num_tokens - 1:
            return
        for sample in request.pending_samples:
            self.block_manager.fork(request.request_id, sample.request_id)
            sample.num_computed_tokens = request.num_computed_tokens
            sample.prompt_logprobs = list(request.prompt_logprobs)
            sample.metrics.first_scheduled_time = request.metrics.first_scheduled_time
            sample.metrics.num_cached_tokens = request.metrics.num_cached_tokens
            sample.status = RequestStatus.RUNNING
            self.running.append(sample)
        request.pending_samples = []

    def _admit_static_batch(self, out: SchedulerOutput) -> None:
        """Static batching: take up to max_num_seqs waiting requests whose prompts all fit."""
        bm = self.block_manager
        blocks_left = bm.num_free_blocks
        while self.waiting and self._has_room_for(self.waiting[0]):
            request = self.waiting[0]
            prefix = self._cached_prefix(request)
            blocks = bm.blocks_needed(request.request_id, request.num_tokens, prefix)
            if blocks > blocks_left:
                break
            blocks_left -= blocks
            self.waiting.popleft()
            if bm.enable_prefix_caching:  # the rest is allocated as it is computed
                self._start_from_prefix(request, prefix, out)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._fork_if_ready(request)  # n > 1 with nothing before the fork point

    def _cached_prefix(self, request: Request) -> list[int]:
        """The request's longest cached run of full blocks ([] when prefix caching is off).

        A request asking for prompt_logprobs takes no cached prefix: cached tokens are never
        run through the model, so they would have no logits to score. It computes its whole
        prompt (and its full blocks still enter the cache for others)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        return bm.lookup_prefix(request.all_token_ids)

    def _start_from_prefix(self, request: Request, prefix: list[int], out: SchedulerOutput) -> None:
        """Count the lookup; share the cached prefix blocks, if any, and skip those tokens."""
        cached_tokens = len(prefix) * self.block_manager.block_size
        if prefix:
            self.block_manager.allocate(request.request_id, cached_tokens, prefix)
            request.num_computed_tokens = cached_tokens
        request.metrics.num_cached_tokens = cached_tokens
        out.num_prefix_query_tokens += request.num_tokens
        out.num_prefix_hit_tokens += cached_tokens

    def _num_new_tokens(self, request: Request, budget: int, skip: int = 0) -> int:
        """Tokens to compute this step; `skip` more are already cached (prefix hit). A group
        not forked yet stops before its last prompt token (each sequence computes that one)."""
        end = request.num_tokens - 1 if request.pending_samples else request.num_tokens
        num_new = end - request.num_computed_tokens - skip
        if num_new > budget:
            if not self.enable_chunked_prefill:
                # Unchunked work larger than the whole budget (a preempted request recomputing
                # prompt + output) runs alone in a step; otherwise it would never run and
                # would block the queue behind it.
                return num_new if budget == self.max_num_batched_tokens else 0
            num_new = budget
        return num_new

    def _reserve(self, request: Request, target_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `request` (a private copy first if it writes into a shared
        block), preempting the newest running requests (whole groups) if needed."""
        while self._blocks_to_write(request, target_tokens) > self.block_manager.num_free_blocks:
            self._preempt_group(self.running[-1], out)
            if request.status is RequestStatus.PREEMPTED:
                return False
        self._allocate(request, target_tokens, out)
        return True

    def _blocks_to_write(self, request: Request, target_tokens: int) -> int:
        """Free blocks that computing up to `target_tokens` takes: new ones, plus a private
        copy of each block written that other sequences share."""
        bm, rid = self.block_manager, request.request_id
        start = request.num_computed_tokens
        return bm.blocks_needed(rid, target_tokens) + bm.num_shared_blocks(
            rid, start, target_tokens
        )

    def _allocate(self, request: Request, target_tokens: int, out: SchedulerOutput) -> None:
        """Copy-on-write the shared blocks about to be written, then grow the table."""
        bm, rid = self.block_manager, request.request_id
        out.block_copies += bm.copy_on_write(rid, request.num_computed_tokens, target_tokens)
        bm.allocate(rid, target_tokens)

    def _preempt_group(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt the victim and every running sequence of its group (a unit: recompute).
        Members already scheduled this step leave the step (their blocks are gone)."""
        group = victim.group_id
        members = [r for r in self.running if r.group_id == group]
        for s in out.scheduled:  # counted by their state before the preemption resets it
            if s.request.group_id == group:
                if s.is_decode:
                    out.num_decode_tokens -= s.num_new_tokens
                else:
                    out.num_prefill_tokens -= s.num_new_tokens
        out.scheduled = [s for s in out.scheduled if s.request.group_id != group]
        for request in reversed(members):  # appendleft: the group keeps its order
            self._preempt(request, out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        # Recompute-style preemption: drop the KV, keep the tokens; the request re-enters
        # at the front of the queue and prefills prompt + output so far when readmitted.
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)

    def _add(
        self, out: SchedulerOutput, request: Request, num_new: int,
        draft: list[int] | None = None, num_draft_slots: int = 0,
    ) -> None:  # fmt: skip
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.perf_counter()
        table = self.block_manager.block_table(request.request_id)
        item = ScheduledRequest(request, num_new, table, draft or [], num_draft_slots)
        out.scheduled.append(item)
        if item.is_decode:
            out.num_decode_tokens += num_new
        else:
            out.num_prefill_tokens += num_new

    # --- after the model ran ---
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        now: float | None = None,
        logprobs: Mapping[str, list[TokenLogprob]] | None = None,
        prompt_logprobs: Mapping[str, list[TokenLogprob]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests at a token stop.

        `sampled` has one token per request that reached its end, or several when drafts were
        verified (accepted drafts + one). `logprobs` has one entry per sampled token (requests
        that asked), `prompt_logprobs` the prompt tokens this step scored. Returns the requests
        that got tokens or finished.
        """
        logprobs = logprobs or {}
        prompt_logprobs = prompt_logprobs or {}
        now = time.perf_counter() if now is None else now
        touched: list[Request] = []
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted later in the same step (its work is discarded)
            tokens = sampled.get(request.request_id, [])
            request.prompt_logprobs.extend(prompt_logprobs.get(request.request_id, ()))
            token_logprobs = logprobs.get(request.request_id)
            # K/V stay valid up to the last accepted draft; rejected drafts' slots get
            # overwritten later (no attention reads past num_computed_tokens).
            num_rejected = item.num_draft_tokens - max(0, len(tokens) - 1)
            request.num_computed_tokens += item.num_new_tokens - num_rejected
            status = None
            for i, token in enumerate(tokens):
                request.output_token_ids.append(token)
                if token_logprobs is not None:
                    request.output_logprobs.append(token_logprobs[i])
                request.metrics.token_times.append(now)
                # A verified step's tokens: the accepted drafts, then the target's own token.
                request.metrics.token_drafted.append(i < len(tokens) - 1)
                status = self._token_stop(request, token)
                if status is not None:
                    break  # tokens after a stop are dropped
            request.num_new_output_tokens = len(request.output_token_ids) - (
                request.metrics.num_output_tokens
            )
            request.metrics.num_output_tokens = request.num_output_tokens
            if tokens:  # a stop inside the accepted drafts leaves fewer tokens than computed
                request.num_computed_tokens = min(
                    request.num_computed_tokens, request.num_tokens - 1
                )
            if self.block_manager.enable_prefix_caching:
                self.block_manager.cache_full_blocks(
                    request.request_id, request.all_token_ids, request.num_computed_tokens
                )
            self._fork_if_ready(request)
            if not tokens:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if status is not None:
                self.finish(request, status)
            touched.append(request)
        return touched

    def _token_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        # min_tokens: no stop before them.
        if not request.below_min_tokens and token in request.ending_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
