"""Held-out perplexity of one model under several engine settings, in one run.

    python -m benchmarks.perplexity                                   # none / int8 / int4 weights
    python -m benchmarks.perplexity --vary kv_cache_dtype=auto,int8,fp8 --context-len 2048
    python -m benchmarks.perplexity --vary quantization=none,int4 --quantization-group-size 32

The text is local and fixed: the CPython documentation topics that ship with Python
(`pydoc_data.topics`, ~465k characters, sorted by topic name), so no data set is downloaded
and every run scores the same tokens. It is cut into `--num-windows` non-overlapping windows of
`--context-len` tokens; each window is one prompt sent with `prompt_logprobs=0` (the engine's
log-probabilities of the raw model logits, docs/logprobs.md), and every token after a window's
first is scored given all the tokens before it in that window. The negative log-likelihood
(NLL) is the mean over all scored tokens, the perplexity exp(NLL).

`--vary FIELD=V1,V2,...` builds one engine per value of that EngineConfig field (the other
flags shared) and reports each, with the change in perplexity relative to the first value.
Prints JSON.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
from collections.abc import Sequence

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.runner.model_loader import load_tokenizer, resolve_model

DEFAULT_VARY = "quantization=none,int8,int4"


def held_out_text() -> str:
    """The CPython documentation topics shipped with Python, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def windows_of(token_ids: Sequence[int], context_len: int, num_windows: int) -> list[list[int]]:
    """The first num_windows non-overlapping windows of context_len tokens."""
    if context_len < 2:
        raise ValueError(
            f"context_len: must be >= 2 (a window scores tokens 1..), got {context_len}"
        )
    windows = [
        list(token_ids[i : i + context_len])
        for i in range(0, len(token_ids) - context_len + 1, context_len)
    ][:num_windows]
    if len(windows) < num_windows:
        raise ValueError(
            f"num_windows: the text has {len(token_ids)} tokens, only {len(windows)} windows of "
            f"{context_len}"
        )
    return windows


def parse_vary(text: str) -> tuple[str, list[str]]:
    """ "field=a,b,c" -> ("field", ["a", "b", "c"]); the field must be an EngineConfig field."""
    name, sep, values = text.partition("=")
    if not sep or not values:
        raise ValueError(f"--vary: expected FIELD=V1,V2,..., got {text!r}")
    if name not in EngineConfig.field_names():
        raise ValueError(f"--vary: {name!r} is not an EngineConfig field")
    return name, [v.strip() for v in values.split(",") if v.strip()]


def score(config: EngineConfig, windows: list[list[int]]) -> dict:
    """NLL and perplexity of `config`'s engine over the windows."""
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate(windows, params)
    logprobs = [lp.logprob for out in outputs for lp in out.prompt_logprobs or [] if lp]
    del llm
    gc.collect()
    expected = sum(len(w) - 1 for w in windows)
    if len(logprobs) != expected:
        raise RuntimeError(f"scored {len(logprobs)} prompt tokens, expected {expected}")
    nll = -sum(logprobs) / len(logprobs)
    return {"nll": round(nll, 5), "perplexity": round(math.exp(nll), 4), "tokens_scored": expected}


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--vary", default=DEFAULT_VARY, help=f"FIELD=V1,V2,... (default {DEFAULT_VARY})")
    p.add_argument("--context-len", type=int, default=512, help="tokens per window")
    p.add_argument("--num-windows", type=int, default=4, help="windows scored")
    args = p.parse_args(argv)
    try:
        field, values = parse_vary(args.vary)
        base = config_from_args(args)
        configs = [dataclasses.replace(base, **{field: _typed(base, field, v)}) for v in values]
        if any(c.max_model_len is not None and c.max_model_len < args.context_len for c in configs):
            raise ValueError("--context-len: longer than max_model_len")
        tokenizer = load_tokenizer(resolve_model(base.model))
        if tokenizer is None:
            raise ValueError(f"model: {base.model!r} has no tokenizer to cut the text with")
        windows = windows_of(
            tokenizer.encode(held_out_text(), add_special_tokens=False),
            args.context_len,
            args.num_windows,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = []
    for config in configs:
        run = {field: getattr(config, field), **score(config, windows)}
        run["perplexity_change_pct"] = (
            round(100 * (run["perplexity"] / runs[0]["perplexity"] - 1), 2) if runs else 0.0
        )
        runs.append(run)
        print(f"{field}={run[field]}: perplexity {run['perplexity']}", file=sys.stderr)
    report = {
        "benchmark": "perplexity",
        "model": base.model,
        "text": "pydoc_data.topics (CPython documentation, sorted by topic)",
        "context_len": args.context_len,
        "num_windows": args.num_windows,
        "vary": field,
        "config": config_report(base),
        "runs": runs,
    }
    emit(report, args.json)
    return 0


def _typed(base: EngineConfig, field: str, value: str) -> object:
    """A --vary value in its field's type (int fields such as block_size; else the string)."""
    current = getattr(base, field)
    if isinstance(current, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    return value


if __name__ == "__main__":
    raise SystemExit(main())
