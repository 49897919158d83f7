"""Requests and what flows out of them: SamplingParams, Request, RequestOutput, RequestMetrics."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

# Bounds that keep every sampling field computable by the sampler (engine/runner/sampler.py)
# in float32/int64 tensors: outside them a request would raise inside the step (and, before
# fault isolation, fail the whole batch) or yield NaN probabilities.
MIN_TEMPERATURE = 1e-2  # logits / T: below this, float32 logits overflow to inf (NaN softmax)
MAX_TEMPERATURE = 100.0  # above this the distribution is uniform to float32 precision anyway
MIN_TOP_P = 1e-6  # smaller keeps only the top token anyway; float32 zero would drop every token
MAX_TOP_K = 2**31 - 1  # values above the vocabulary keep every token
MIN_REPETITION_PENALTY = 1e-2  # logits / penalty must stay finite in float32
MAX_REPETITION_PENALTY = 100.0
MAX_ADDITIVE_PENALTY = 2.0  # presence / frequency penalty magnitude (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a bias's magnitude (OpenAI's range: +-100 bans or forces a token)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most 64 bits
# Most alternatives returned per token (OpenAI's top_logprobs cap, vLLM's default max_logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated at construction: a bad value raises
    ValueError("<field>: ...") and never reaches the engine thread."""

    max_tokens: int = 64  # most new tokens to generate
    temperature: float = 1.0  # 0 = greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    top_p: float = 1.0  # nucleus mass kept, in [MIN_TOP_P, 1]
    top_k: int = -1  # -1 = all tokens, else in [1, MAX_TOP_K]
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob; in [0, 1]
    seed: int | None = None  # per-request RNG in [0, MAX_SEED]; same seed -> same tokens
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (included in token_ids)
    ignore_eos: bool = False  # keep going past EOS (benchmarks with exact lengths)
    # Tokens generated before any stop may end the request (vLLM's min_tokens): until then the
    # stop tokens (EOS unless ignore_eos, stop_token_ids) are masked out of the sampled
    # distribution and neither stop tokens nor stop strings end it. In [0, max_tokens].
    min_tokens: int = 0
    # > 1 discourages tokens already in prompt or output; in [MIN_, MAX_REPETITION_PENALTY]
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties on the output so far (not the prompt, as OpenAI and vLLM):
    # logit -= presence_penalty once a token appeared, and frequency_penalty x its count. In
    # [-MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY]; negative values encourage repeats.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Added to the logits of these token ids before anything else: -100 bans a token, +100
    # all but forces it. A mapping {token id: bias} (ids as ints or strings of ints, as the
    # OpenAI API sends them), stored as sorted (id, bias) pairs so the params stay hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities of the raw model logits (before bias, penalties and temperature: see
    # docs/logprobs.md). None = off; k in [0, MAX_LOGPROBS] = each generated token's logprob
    # and rank plus the k most likely tokens at its position.
    logprobs: int | None = None
    # The same for every prompt token after the first (the basis of perplexity). A request
    # with prompt_logprobs computes its whole prompt: it skips the prefix cache.
    prompt_logprobs: int | None = None
    # Parallel sampling: n sequences from one prompt, sharing its KV blocks (copy-on-write
    # for the last, partly filled one), sequence i seeded seed + i. Greedy n > 1 is allowed
    # and gives n identical sequences (every one takes the argmax). The engine caps n at
    # max_num_seqs (all n run at once).
    n: int = 1

    def __post_init__(self) -> None:
        # Accept a lone string / list for convenience, store tuples so the params stay hashable.
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int)
        )
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("n", self.n, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if not (_is_real(self.temperature) and self.temperature == 0):
            _check_real("temperature", self.temperature, MIN_TEMPERATURE, MAX_TEMPERATURE,
                        "0 (greedy) or ")  # fmt: skip
        _check_real("top_p", self.top_p, MIN_TOP_P, 1.0)
        if _is_int(self.top_k) and self.top_k == 0:
            raise ValueError("top_k: 0 keeps no token; use -1 to turn top-k off")
        if not (_is_int(self.top_k) and self.top_k == -1):
            _check_int("top_k", self.top_k, 1, MAX_TOP_K, "-1 (off) or ")
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                    MAX_REPETITION_PENALTY)  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED, "None or ")
        if any(not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative integers, got "
                             f"{list(self.stop_token_ids)!r}")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, "None or ")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether a logit bias or a penalty applies (engine/runner/sampler.py's
        apply_penalties), so the sampler needs the request's token history."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not here


def _check_int(name: str, value: object, low: int, high: int | None, alt: str = "") -> None:
    """`value` is an int (not a bool) in [low, high]; the message names the field."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: must be {alt}an integer {span}, got {value!r}")


def _check_real(name: str, value: object, low: float, high: float, alt: str = "") -> None:
    """`value` is a finite int or float (not a bool, not a string) in [low, high]."""
    if not _is_real(value) or not low <= value <= high:
        raise ValueError(f"{name}: must be {alt}a number in [{low:g}, {high:g}], got {value!r}")


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: from a mapping (ids as ints or decimal
    strings, as JSON object keys arrive), or pairs already normalized."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(
        isinstance(x, tuple | list) and len(x) == 2 for x in value
    ):
        items = [tuple(x) for x in value]
    else:
        raise ValueError(f"logit_bias: must map token ids to biases, got {value!r}")
    pairs = {}
    for key, bias in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {key!r}")
        if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: token {token}'s bias must be a number in "
                             f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")  # fmt: skip
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _as_tuple(name: str, value: object, kind: type) -> tuple:
    """A lone string (stop) or a list/tuple of `kind` as a tuple; None means empty."""
    if value is None:
        return ()
    if kind is str and isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name}: must be a list of {kind.__name__}, got {value!r}")
    ok = _is_int if kind is int else (lambda x: isinstance(x, str))
    if not all(ok(x) for x in value):
        raise ValueError(f"{name}: must be a list of {kind.__name__}, got {list(value)!r}")
    return tuple(value)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability at its position, from log_softmax of the raw logits."""

    token_id: int
    logprob: float  # natural log; <= 0
    rank: int  # 1 = the most likely token at this position
    # The k most likely tokens there, most likely first: (token id, logprob); k = the
    # request's logprobs / prompt_logprobs setting (may or may not include token_id).
    top: tuple[tuple[int, float], ...] = ()


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
    # Per output token: True where it was a speculative draft the target model accepted, False
    # where the target sampled it itself (one per step). All False without speculative decoding.
    token_drafted: list[bool] = field(default_factory=list)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(self.token_drafted)

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
    # Output tokens the last step appended: 1, or up to k + 1 when k drafts were verified.
    num_new_output_tokens: int = 0
    output_text: str = ""
    # One per output token when params.logprobs is set (kept aligned with output_token_ids).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt tokens 1.. (token 0 has no context) when params.prompt_logprobs is set; filled
    # chunk by chunk during prefill and never recomputed after a preemption.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Incremental detokenization state (engine/core/detokenizer.py sets it at admission).
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    num_text_chars_sent: int = 0  # output_text already handed to the caller
    # Parallel sampling (params.n > 1): the request is the group's sequence 0 until its
    # prompt (but the last token) is computed; then the scheduler forks `pending_samples`
    # (sequences 1 .. n-1) off it, sharing its blocks. Every sequence answers to group_id.
    group_id: str = ""  # the caller's request id ("" = request_id)
    sample_index: int = 0  # which of the n sequences (its seed is params.seed + index)
    pending_samples: list[Request] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
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
    def below_min_tokens(self) -> bool:
        """Whether the request still owes tokens before a stop may end it (min_tokens)."""
        return self.num_output_tokens < self.params.min_tokens

    @property
    def ending_token_ids(self) -> tuple[int, ...]:
        """The tokens that end this request when generated: its stop_token_ids, and EOS
        unless ignore_eos."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return (*self.params.stop_token_ids, *eos)

    def masked_stop_token_ids(self, num_ahead: int = 0) -> tuple[int, ...]:
        """The tokens the sampler masks out of the output token `num_ahead` past the next one:
        the ending tokens, while that token would still fall below min_tokens; else none."""
        if self.num_output_tokens + num_ahead >= self.params.min_tokens:
            return ()
        return self.ending_token_ids

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
    def seed(self) -> int | None:
        """This sequence's seed: the request's, + its index among the n (wrapping at 2^64)."""
        seed = self.params.seed
        return None if seed is None else (seed + self.sample_index) % (MAX_SEED + 1)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass
class RequestOutput:
    """What callers see: cumulative tokens/text plus the delta since the previous output."""

    request_id: str  # the caller's id (every one of the n sequences answers to it)
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far
    new_token_ids: list[int]  # tokens added by this delta
    new_text: str  # text added by this delta
    finished: bool  # this sequence is over (with n > 1 others may still run)
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    metrics: RequestMetrics
    error: str | None = None  # set when the engine failed the request
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry (params.logprobs)
    new_logprobs: list[TokenLogprob] | None = None  # those of new_token_ids
    # One per prompt token, the first None (no context); set once the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's n sequences this delta belongs to
    # Every sequence of the request is over: the request's last delta (a stream ends on it).
    # The engine sets it; with n = 1 it equals `finished`.
    request_finished: bool = False
