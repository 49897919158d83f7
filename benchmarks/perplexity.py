"""Held-out perplexity of one model under several engine settings, in one run.

    python -m benchmarks.perplexity                              # none / int8 / int4 / awq weights
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
import sys
from collections.abc import Sequence

from benchmarks.common import bench_parser, config_report, emit, parse_vary, vary_configs
from engine.config import EngineConfig
from engine.llm import LLM
from engine.quality import (
    HELD_OUT_TEXT_NAME,
    SCORE_PARAMS,
    held_out_text,
    mean_nll,
    perplexity,
    windows_of,
)
from engine.runner.model_loader import load_tokenizer, resolve_model

# awq: the embedded model's AutoAWQ checkpoint (engine/quantize; made once if missing).
DEFAULT_VARY = "quantization=none,int8,int4,awq"


def score(config: EngineConfig, windows: list[list[int]]) -> dict:
    """NLL and perplexity of `config`'s engine over the windows."""
    llm = LLM(**dataclasses.asdict(config))
    nll = mean_nll(llm.generate(windows, SCORE_PARAMS), windows)
    del llm
    gc.collect()
    scored = sum(len(w) - 1 for w in windows)
    return {"nll": round(nll, 5), "perplexity": round(perplexity(nll), 4), "tokens_scored": scored}


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--vary", default=DEFAULT_VARY, help=f"FIELD=V1,V2,... (default {DEFAULT_VARY})")
    p.add_argument("--context-len", type=int, default=512, help="tokens per window")
    p.add_argument("--num-windows", type=int, default=4, help="windows scored")
    args = p.parse_args(argv)
    try:
        field, values = parse_vary(args.vary)
        configs = vary_configs(args, field, values)
        base = configs[0]
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
        "text": HELD_OUT_TEXT_NAME,
        "context_len": args.context_len,
        "num_windows": args.num_windows,
        "vary": field,
        "config": config_report(base),
        "runs": runs,
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
