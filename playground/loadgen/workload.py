"""Load-test workloads: length distributions, prompts (random token ids or a JSONL dataset),
and request arrival times. Pure and seeded: the same WorkloadSpec gives the same requests."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

LengthKind = Literal["fixed", "uniform", "normal"]


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer a workload needs."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token lengths.

    fixed:   always `mean`.
    uniform: integers drawn uniformly from [low, high] (both inclusive).
    normal:  round(N(mean, std)), clipped to [low, high] (low defaults to 1, high to none).
    """

    kind: LengthKind = "fixed"
    mean: int = 128
    low: int | None = None
    high: int | None = None
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"kind: must be fixed, uniform or normal; got {self.kind!r}")
        if not isinstance(self.mean, int) or self.mean < 1:
            raise ValueError(f"mean: must be a positive integer, got {self.mean!r}")
        if self.low is not None and self.low < 1:
            raise ValueError(f"low: must be >= 1, got {self.low}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low/high: low {self.low} > high {self.high}")
        if self.kind == "uniform" and (self.low is None or self.high is None):
            raise ValueError("low/high: a uniform distribution needs both bounds")
        if self.kind == "normal" and not (math.isfinite(self.std) and self.std > 0):
            raise ValueError(f"std: a normal distribution needs std > 0, got {self.std!r}")

    @classmethod
    def fixed(cls, num_tokens: int) -> LengthDist:
        return cls("fixed", num_tokens)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", max(1, (low + high) // 2), low, high)

    @classmethod
    def normal(
        cls, mean: int, std: float, low: int | None = None, high: int | None = None
    ) -> LengthDist:
        return cls("normal", mean, low, high, float(std))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.mean] * n
        if self.kind == "uniform":
            return rng.integers(self.low, self.high, size=n, endpoint=True).tolist()
        lengths = np.rint(rng.normal(self.mean, self.std, size=n))
        lengths = np.clip(lengths, self.low or 1, self.high or np.inf)
        return lengths.astype(int).tolist()

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.mean)
        if self.kind == "uniform":
            return f"uniform[{self.low}, {self.high}]"
        return f"normal({self.mean}, {self.std:g})"


def _as_length_dist(value: LengthDist | int, name: str) -> LengthDist:
    if isinstance(value, LengthDist):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return LengthDist.fixed(value)
    raise ValueError(f"{name}: must be a LengthDist or an int, got {value!r}")


DEFAULT_INPUT_LEN = LengthDist.fixed(128)
DEFAULT_OUTPUT_LEN = LengthDist.fixed(64)


@dataclass(frozen=True)
class WorkloadSpec:
    """What a load test sends and when. Same spec + same tokenizer -> same requests."""

    num_prompts: int = 100
    request_rate: float = math.inf  # requests/s; inf sends every request at time 0
    burstiness: float = 1.0  # gamma shape of the arrival gaps; 1 = Poisson, < 1 burstier
    max_concurrency: int | None = None  # most requests in flight; None = no limit
    input_len: LengthDist = DEFAULT_INPUT_LEN  # tokens after the shared prefix
    output_len: LengthDist = DEFAULT_OUTPUT_LEN  # max_tokens per request
    prefix_len: int = 0  # random tokens shared by every prompt (prefix-cache workloads)
    dataset: str | None = None  # JSONL of prompts; replaces the random input tokens
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 = off (an extension over HTTP: vLLM, SGLang, ours)
    min_p: float = 0.0  # 0 = off (an extension over HTTP)
    ignore_eos: bool = True  # exact output lengths (servers that lack it may ignore it)
    # Samples per prompt (SamplingParams.n, the completions API's `n`). A request's output
    # tokens count every sample's, as OpenAI's usage does, so TPOT is per token of all n.
    n: int = 1
    num_warmups: int = 0  # requests sent (and discarded) before the measured run

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_len", _as_length_dist(self.input_len, "input_len"))
        object.__setattr__(self, "output_len", _as_length_dist(self.output_len, "output_len"))
        if not isinstance(self.num_prompts, int) or self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be a positive integer, got {self.num_prompts!r}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate: must be > 0 (inf = all at once), got {self.request_rate}"
            )
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1 or None, got {self.max_concurrency}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len: must be >= 0, got {self.prefix_len}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k: must be -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n: must be a positive integer, got {self.n!r}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups: must be >= 0, got {self.num_warmups}")

    def replace(self, **changes: Any) -> WorkloadSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


@dataclass(frozen=True)
class GenRequest:
    """One request of a workload, target-independent."""

    index: int
    prompt: str | list[int]  # token ids (random workloads, prefixes) or text (datasets)
    prompt_len: int  # prompt tokens as counted by the workload's tokenizer
    output_len: int  # max_tokens to ask for


@dataclass(frozen=True)
class DatasetPrompt:
    """One usable line of a JSONL dataset."""

    text: str
    output_len: int | None = None  # the line's own max_tokens / output_len, if it has one


# --- datasets --------------------------------------------------------------------------------

_USER_ROLES = ("human", "user")


def parse_dataset_record(record: Any) -> DatasetPrompt | None:
    """A prompt from one dataset record, or None when the record has no usable prompt.

    Accepted shapes:
      {"prompt": "...", "output_len": 128}           (output_len / max_tokens optional)
      {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}  (ShareGPT)
      {"messages": [{"role": "user", "content": "..."}, ...]}                       (OpenAI)
    A conversation's prompt is its first user turn.
    """
    if isinstance(record, str):
        return DatasetPrompt(record) if record.strip() else None
    if not isinstance(record, dict):
        return None
    output_len = record.get("output_len", record.get("max_tokens"))
    if not (isinstance(output_len, int) and output_len > 0):
        output_len = None
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str) and record[key].strip():
            return DatasetPrompt(record[key], output_len)
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return None
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role in _USER_ROLES and isinstance(text, str) and text.strip():
            return DatasetPrompt(text, output_len)
    return None


def load_dataset(path: str | Path) -> list[DatasetPrompt]:
    """Prompts of a JSONL file (one record per line). A .json file holding one list of
    records (the original ShareGPT dump) is read too. Records without a prompt are skipped."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset: {path}:{line_no} is not valid JSON ({e.msg})") from e
    prompts = [p for p in map(parse_dataset_record, records) if p is not None]
    if not prompts:
        raise ValueError(f"dataset: {path} holds no usable prompt")
    return prompts


# --- requests --------------------------------------------------------------------------------


def vocabulary_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Token ids safe to put in a random prompt: the base vocabulary minus special tokens."""
    vocab_size = getattr(tokenizer, "vocab_size", None) or len(tokenizer)  # type: ignore[arg-type]
    ids = np.arange(vocab_size)
    special = [i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None]
    return ids[~np.isin(ids, special)]


def build_requests(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[GenRequest]:
    """The spec's requests. Random workloads get token-id prompts of exactly
    prefix_len + input_len tokens; dataset workloads get the dataset's text (as token ids when a
    shared prefix is asked for, so the prefix stays exact)."""
    rng = np.random.default_rng([spec.seed, 0])
    n = spec.num_prompts
    output_lens = spec.output_len.sample(rng, n)
    vocab = vocabulary_ids(tokenizer) if spec.dataset is None or spec.prefix_len else None
    prefix = rng.choice(vocab, size=spec.prefix_len).tolist() if spec.prefix_len else []

    if spec.dataset is None:
        input_lens = spec.input_len.sample(rng, n)
        return [
            GenRequest(i, prefix + rng.choice(vocab, size=k).tolist(), len(prefix) + k, out)
            for i, (k, out) in enumerate(zip(input_lens, output_lens, strict=True))
        ]

    dataset = load_dataset(spec.dataset)
    # Shuffle once, then cycle when more prompts are asked for than the file holds.
    order = np.concatenate([rng.permutation(len(dataset)) for _ in range(-(-n // len(dataset)))])
    requests = []
    for i, out in enumerate(output_lens):
        item = dataset[int(order[i])]
        ids = tokenizer.encode(item.text, add_special_tokens=False)
        prompt: str | list[int] = prefix + ids if prefix else item.text
        requests.append(GenRequest(i, prompt, len(prefix) + len(ids), item.output_len or out))
    return requests


def build_warmup_requests(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[GenRequest]:
    """Warm-up requests shaped like the workload but drawn with another seed, so they
    share no prompt (nor prefix-cache blocks) with the measured requests."""
    if spec.num_warmups == 0:
        return []
    warm = spec.replace(num_prompts=spec.num_warmups, seed=spec.seed + 1_000_003, num_warmups=0)
    return build_requests(warm, tokenizer)


# --- arrivals --------------------------------------------------------------------------------


def arrival_offsets_s(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send time of each request, in seconds after the start, as `vllm bench serve` draws them.

    Gaps between consecutive requests are Gamma(shape=burstiness, scale=1/(rate*burstiness)):
    mean 1/rate whatever the burstiness; burstiness 1 is exponential (Poisson arrivals), < 1
    burstier, > 1 more regular. The first request goes at 0; rate inf sends all at 0.
    """
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, 1])
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps_s[:-1])])[:num_requests]
