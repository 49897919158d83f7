"""KV-cache quantization benchmark: 16-bit vs int8 (vs fp8) K/V at the same KV memory budget.

    python -m benchmarks.kv_quant                       # 8 x 1024-token prompts, 104 MiB of KV
    python -m benchmarks.kv_quant --kv-dtypes auto int8 fp8 --json results/bench_kvq.json

Long-context workload: every request is a 1024-token prompt (random token ids) plus 32 greedy
tokens (ignore_eos), all submitted at once. The default budget holds all 8 requests' KV in int8
(8 x 1056 tokens x 11,880 bytes) but about half of them in bfloat16, so the 16-bit side must
queue or preempt. Per KV format it prints: blocks and tokens the budget holds, peak blocks
used, preemptions, most requests running at once, TTFT p50/p99, duration and throughput.

With --calculate-kv-scales the fp8 run's scales come from its first batch: the 4-token
warm-up prompt (as a server's first request would set them).

Quality: greedy agreement with 16-bit KV on 8 fixed short prompts (24 tokens each): tokens
equal to the 16-bit run's before each sequence's first difference, over all tokens.
Perplexity (the issue's quality target) waits for the logprobs work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import sys
import time

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.telemetry.stats import latency_summary

DEFAULT_BUDGET_BYTES = 104 << 20
AGREEMENT_PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "Once upon a time, there was",
    "The chemical symbol for gold is",
    "Translate to French: good morning",
    "A haiku about autumn:",
    "The largest planet in the solar system is",
]
AGREEMENT_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tokens_before_divergence(reference: list[list[int]], other: list[list[int]]) -> int:
    """Greedy tokens equal to the reference's up to each sequence's first difference (after
    one, the contexts differ and later tokens say nothing more about the KV format)."""
    total = 0
    for ref, tokens in zip(reference, other, strict=True):
        pairs = zip(ref, tokens, strict=True)
        total += next((i for i, (a, b) in enumerate(pairs) if a != b), len(ref))
    return total


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.workload_seed)
    return [
        [rng.randrange(100, vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]


def measure(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once on a fresh engine (after a warm-up); the engine is released after."""
    llm = LLM(**dataclasses.asdict(config))
    llm.generate([[101, 102, 103, 104]], SamplingParams(max_tokens=2))  # warm-up
    first_step = llm.engine.num_steps
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration_s = time.perf_counter() - start
    stats = llm.stats()
    steps = [s for s in stats.steps if s.step_index >= first_step]
    agreement_tokens = [o.token_ids for o in llm.generate(AGREEMENT_PROMPTS, AGREEMENT_PARAMS)]
    del llm
    gc.collect()
    ttft = latency_summary([o.metrics.ttft_s for o in outputs])
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "kv_cache_dtype": config.kv_cache_dtype,
        "config": config_report(config),
        "kv_cache_bytes": stats.kv_cache_bytes,
        "num_kv_blocks": stats.num_kv_blocks,
        "tokens_held": stats.num_kv_blocks * stats.block_size,
        "peak_blocks_used": max(s.num_blocks_used for s in steps),
        "preemptions": sum(s.num_preemptions for s in steps),
        "max_running_requests": max(s.num_running for s in steps),
        "ttft_p50_s": round(ttft["median"], 3),
        "ttft_p99_s": round(ttft["p99"], 3),
        "duration_s": round(duration_s, 3),
        "output_tokens_per_s": round(generated / duration_s, 2),
        "total_tokens_per_s": round((generated + sum(map(len, prompts))) / duration_s, 2),
        "agreement_token_ids": agreement_tokens,
    }


def run_config(config: EngineConfig, kv_cache_dtype: str) -> EngineConfig:
    """`config` with this run's KV format; --calculate-kv-scales / --kv-scale-granularity
    apply to the fp8 run only (EngineConfig refuses them with the other formats)."""
    return config.with_kv_cache_dtype(kv_cache_dtype)


def build_parser() -> argparse.ArgumentParser:
    # --kv-cache-dtype is not a flag: the benchmark runs each of --kv-dtypes.
    p = bench_parser(__doc__, exclude=("kv_cache_dtype", "kv_cache_memory_bytes"))
    p.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8"],
                   choices=["auto", "int8", "fp8"], help="the first is the reference")  # fmt: skip
    p.add_argument("--kv-budget-bytes", type=int, default=DEFAULT_BUDGET_BYTES,
                   help="KV memory budget of every run (kv_cache_memory_bytes)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    # dest apart from EngineConfig.seed, which config_from_args would take it for.
    p.add_argument("--seed", dest="workload_seed", type=int, default=0, help="seeds the workload")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Built as fp8, the one format that takes every scale flag; each run sets its own format.
    config = config_from_args(
        args, kv_cache_memory_bytes=args.kv_budget_bytes, kv_cache_dtype="fp8"
    )
    probe = LLM(
        **dataclasses.asdict(run_config(config, args.kv_dtypes[0]).replace(num_kv_blocks=4))
    )
    vocab_size = probe.engine.source.arch.vocab_size
    del probe
    prompts = make_prompts(args, vocab_size)
    runs = [measure(run_config(config, kv), prompts, args.output_len) for kv in args.kv_dtypes]
    reference = runs[0]["agreement_token_ids"]
    num_agreement_tokens = sum(len(t) for t in reference)
    for run in runs:
        tokens = run.pop("agreement_token_ids")
        run["greedy_agreement"] = round(
            tokens_before_divergence(reference, tokens) / num_agreement_tokens, 3
        )
    base = runs[0]
    report = {
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "arrivals": "all at once",
            "kv_budget_bytes": args.kv_budget_bytes,
            "seed": args.workload_seed,
        },
        "runs": runs,
        "vs_first": {
            run["kv_cache_dtype"]: {
                "tokens_held_ratio": round(run["tokens_held"] / base["tokens_held"], 3),
                "throughput_ratio": round(
                    run["output_tokens_per_s"] / base["output_tokens_per_s"], 3
                ),
                "preemptions": [base["preemptions"], run["preemptions"]],
            }
            for run in runs[1:]
        },
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
