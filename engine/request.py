"""Requests and what flows out of them: SamplingParams, Request, RequestOutput, RequestMetrics."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64  # most new tokens to generate
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob
    seed: int | None = None  # per-request RNG; same seed -> same tokens, whatever the batch
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (included in token_ids)
    ignore_eos: bool = False  # keep going past EOS (benchmarks with exact lengths)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output

    def __post_init__(self) -> None:
        # Accept a lone string / list for convenience, store tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens: must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.top_k == 0:
            raise ValueError("top_k: 0 keeps no token; use -1 to turn top-k off")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token appeared
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (last) admission

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (n - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


_request_counter = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_request_counter)}"


@dataclass
class Request:
    """One request inside the engine. Owned by the engine thread; never shared with callers."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0  # prompt + output cap (max_model_len)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the cache. A step schedules tokens [num_computed_tokens, ...).
    num_computed_tokens: int = 0
    # Speculative decoding: tokens guessed to follow (verified by the next step, then cleared),
    # and how many output tokens the last step appended (1, or up to k + 1 with drafts).
    draft_token_ids: list[int] = field(default_factory=list)
    num_new_output_tokens: int = 0
    output_text: str = ""
    # Incremental detokenization state (engine/core/detokenizer.py sets it at admission).
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    num_text_chars_sent: int = 0  # output_text already handed to the caller
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(
            arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids)
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass
class RequestOutput:
    """What callers see: cumulative tokens/text plus the delta since the previous output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    new_token_ids: list[int]  # tokens added by this delta
    new_text: str  # text added by this delta
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics
    error: str | None = None  # set when the engine failed the request
