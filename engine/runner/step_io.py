"""The model runner's step messages: StepInputs (one step packed as host lists), PromptRows
(logit rows of prompt tokens, for prompt_logprobs) and RunnerOutput (what a step produced,
the runner's single message back to the engine)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.core.scheduler import ScheduledRequest
from engine.request import Request, TokenLogprob

logger = logging.getLogger("engine.runner.model_runner")


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced: the runner's single message back to the engine."""

    # Request id -> new tokens: one sampled token, or the accepted drafts plus one. Only for
    # requests that reached their end this step and did not fail.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # Request id -> why its sampling or verification raised (it alone failed; the engine
    # aborts it with this message, the step's other requests keep their tokens).
    failed: dict[str, str] = field(default_factory=dict)
    # Request id -> one TokenLogprob per token in `sampled` (requests with params.logprobs).
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Request id -> logprobs of the prompt tokens this step's chunk predicted, continuing
    # where request.prompt_logprobs ends (requests with params.prompt_logprobs).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # speculative_method="draft": seconds the draft model took (catch-up + proposals).
    draft_time_s: float = 0.0
    # Its forward passes: (new tokens per request, context per request, LM-head rows) each.
    draft_passes: list[tuple[list[int], list[int], int]] = field(default_factory=list)


@dataclass(frozen=True)
class PromptRows:
    """The logit rows of one request's prompt tokens in a step (prompt_logprobs)."""

    request: Request
    first_row: int  # index into the step's logits of the row predicting first_token
    first_token: int  # index into the prompt of the first token scored
    num_tokens: int  # prompt tokens scored (consecutive)


@dataclass(frozen=True)
class StepInputs:
    """One step's requests packed decode-first, as host lists (tensors are made per path)."""

    requests: list[ScheduledRequest]  # decodes (one new token each) first, then the rest
    num_decodes: int
    input_ids: list[int]  # [T]: each request's new tokens, then its draft tokens
    positions: list[int]  # [T]
    slots: list[int]  # [T] KV slot of each new token

    @property
    def decodes(self) -> list[ScheduledRequest]:
        return self.requests[: self.num_decodes]

    @property
    def prefills(self) -> list[ScheduledRequest]:
        return self.requests[self.num_decodes :]


def fail_request(request: Request, stage: str, exc: Exception, result: RunnerOutput) -> None:
    """One request's sampling, verification or scoring raised: it alone fails."""
    logger.exception("request %s failed in %s", request.request_id, stage)
    result.failed[request.request_id] = f"{stage} failed: {type(exc).__name__}: {exc}"
