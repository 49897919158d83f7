"""Prefix-caching benchmark: the same shared-prefix workload with the cache off, then on.

    python -m benchmarks.prefix                          # 32 requests, 512-token shared prefix
    python -m benchmarks.prefix --prefix-len 1024 --json results/bench_prefix.json

Every prompt is one shared prefix (a long system prompt or document, random token ids) plus
its own suffix; outputs are exact (ignore_eos), greedy, bfloat16. Requests arrive one at a
time, each after the previous one finished (a chat user, an agent loop): the case prefix
caching is for. The first request computes the prefix; with the cache on, the others find it.
Prints JSON: prompt tokens computed vs found cached, TTFT p50/p99, end-to-end time, and the
ratios, plus a check that both runs produced the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys

from benchmarks.common import bench_parser, config_report, emit, run_one_at_a_time
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.telemetry.stats import latency_summary


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.workload_seed)
    prefix = [rng.randrange(100, vocab_size) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(100, vocab_size) for _ in range(rng.randint(*args.suffix_len))]
        for _ in range(args.num_requests)
    ]


def measure(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    run = run_one_at_a_time(config, prompts, params)
    ttft = latency_summary([o.metrics.ttft_s for o in run.outputs])
    return {
        "prefix_caching": config.enable_prefix_caching,
        "config": config_report(config),
        "duration_s": round(run.duration_s, 3),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": sum(s.num_prefill_tokens for s in run.steps),
        "prompt_tokens_cached": sum(s.num_prefix_hit_tokens for s in run.steps),
        "ttft_p50_s": round(ttft["median"], 4),
        "ttft_p99_s": round(ttft["p99"], 4),
        "token_ids": [o.token_ids for o in run.outputs],
    }


def build_parser() -> argparse.ArgumentParser:
    # --enable-prefix-caching is not a flag: the benchmark runs with the cache off, then on.
    p = bench_parser(__doc__, exclude=("enable_prefix_caching",))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512, help="tokens shared by every prompt")
    p.add_argument("--suffix-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=16)
    # dest apart from EngineConfig.seed, which config_from_args would take it for.
    p.add_argument("--seed", dest="workload_seed", type=int, default=0, help="seeds the workload")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)

    probe = LLM(**dataclasses.asdict(config.replace(num_kv_blocks=4)))
    vocab_size = probe.engine.source.arch.vocab_size
    del probe
    prompts = make_prompts(args, vocab_size)
    off = measure(config.replace(enable_prefix_caching=False), prompts, args.output_len)
    on = measure(config.replace(enable_prefix_caching=True), prompts, args.output_len)
    same_tokens = off.pop("token_ids") == on.pop("token_ids")
    report = {
        "workload": {
            "num_requests": args.num_requests,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "output_len": args.output_len,
            "arrivals": "one at a time",
            "seed": args.workload_seed,
        },
        "runs": [off, on],
        "same_tokens": same_tokens,
        "prompt_tokens_computed_ratio_on_vs_off": round(
            on["prompt_tokens_computed"] / off["prompt_tokens_computed"], 3
        ),
        "ttft_p50_speedup": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
        "duration_speedup": round(off["duration_s"] / on["duration_s"], 2),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
