"""Parallel sampling benchmark: n samples of one prompt as one request (n > 1: the samples
share the prompt's KV blocks, copy-on-write for the partly filled last one) vs as n separate
requests (seeds seed .. seed + n - 1, each computing the prompt itself).

    python -m benchmarks.parallel                        # n = 4, a 480-token prompt
    python -m benchmarks.parallel --n 8 --json results/bench_parallel.json

Both runs send everything at once and sample at a temperature with the same seeds, so sample
i of the shared run equals request i of the other (checked: same_tokens). Prints JSON: peak
KV blocks held, prompt tokens computed, copy-on-write block copies, engine steps, wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams


def measure(config: EngineConfig, prompt: list[int], args: argparse.Namespace, shared: bool):
    llm = LLM(**dataclasses.asdict(config))
    engine = llm.engine
    sample = dict(max_tokens=args.output_len, temperature=0.8, ignore_eos=True)
    if shared:
        requests = [
            engine.make_request(prompt, SamplingParams(n=args.n, seed=args.sample_seed, **sample))
        ]
    else:
        requests = [engine.make_request(prompt, SamplingParams(seed=args.sample_seed + i, **sample))
                    for i in range(args.n)]  # fmt: skip
    for request in requests:
        engine.add(request)
    peak_blocks, outputs = 0, {}
    first_step, start = engine.num_steps, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step_or_raise():
            if out.finished:
                outputs[(out.request_id, out.index)] = out.token_ids
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    duration_s = time.perf_counter() - start
    steps = engine.stats().steps[-(engine.num_steps - first_step) :]
    return {
        "shared": shared,
        "config": config_report(config),
        "peak_kv_blocks": peak_blocks,
        "prompt_tokens_computed": sum(s.num_prefill_tokens for s in steps),
        "block_copies": sum(s.num_block_copies for s in steps),
        "engine_steps": len(steps),
        "duration_s": round(duration_s, 3),
        # Sample i of the shared request, request i of the separate ones.
        "token_ids": [outputs[(r.group_id, i)] for r in requests for i in range(r.params.n)],
    }


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__)
    p.add_argument("--n", type=int, default=4, help="samples of the prompt")
    p.add_argument("--prompt-len", type=int, default=480, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=32)
    # dest apart from EngineConfig.seed, which config_from_args would take it for.
    p.add_argument("--seed", dest="sample_seed", type=int, default=0, help="sample i: seed + i")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    vocab_size = LLM(
        **dataclasses.asdict(config.replace(num_kv_blocks=4))
    ).engine.source.arch.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab_size) for _ in range(args.prompt_len)]
    separate = measure(config, prompt, args, shared=False)
    shared = measure(config, prompt, args, shared=True)
    same_tokens = separate.pop("token_ids") == shared.pop("token_ids")
    report = {
        "workload": {
            "n": args.n,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "seed": args.sample_seed,
            "arrivals": "all at once",
        },
        "runs": [separate, shared],
        "same_tokens": same_tokens,
        "peak_kv_blocks_ratio_shared_vs_separate": round(
            shared["peak_kv_blocks"] / separate["peak_kv_blocks"], 3
        ),
        "prompt_tokens_computed_ratio_shared_vs_separate": round(
            shared["prompt_tokens_computed"] / separate["prompt_tokens_computed"], 3
        ),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
