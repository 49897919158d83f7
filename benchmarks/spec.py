"""Speculative-decoding benchmark: copy-heavy prompts, one at a time, n-gram drafts off then on.

    python -m benchmarks.spec                      # the embedded model, bfloat16, 64 tokens each
    python -m benchmarks.spec --num-speculative-tokens 6 --json results/bench_spec.json

N-gram drafts help when the output repeats its context: copying, lists, code edits,
structured output. The prompts below ask for exactly that. Requests run one at a time (batch 1:
decode is latency-bound, the case drafts are for), greedy. Prints JSON: output tokens/s, TPOT
p50, draft tokens verified and accepted, tokens per decode step, and how many requests gave
the same tokens both ways (in bfloat16 a step computing k + 1 positions rounds differently
from one computing 1, so a near-tie can flip; in float32 they are identical, as tested).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import bench_parser, config_report, emit, run_one_at_a_time
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.telemetry.stats import latency_summary

PROMPTS = [
    "Copy this text exactly.\nText: The mitochondria is the powerhouse of the cell. It produces "
    "energy through respiration.\nCopy: The mitochondria",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat the list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple,",
    '<ul>\n  <li>Home</li>\n  <li>About</li>\n  <li>Contact</li>\n</ul>\nThe same list as JSON: ["Home",',
    "Rewrite with 'cat' replaced by 'dog': The cat sat on the mat. The cat was happy. The cat "
    "slept.\nRewritten: The dog sat",
    "Count from one to twenty in words: one, two, three, four, five,",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, age FROM users WHERE age > 40;\n"
    "SELECT name,",
    "Q: What is the capital of France?\nA: The capital of France is Paris.\nQ: What is the capital "
    "of Italy?\nA:",
]


def measure(config: EngineConfig, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    run = run_one_at_a_time(config, PROMPTS, params)
    outputs = run.outputs
    decode_steps = [s for s in run.steps if s.kind == "decode"]
    num_tokens = sum(len(o.token_ids) for o in outputs)
    tpot = latency_summary([t for o in outputs if (t := o.metrics.tpot_s)])
    drafts = sum(s.num_draft_tokens for s in run.steps)
    accepted = sum(s.num_accepted_tokens for s in run.steps)
    return {
        "speculative_method": config.speculative_method,
        "config": config_report(config),
        "duration_s": round(run.duration_s, 3),
        "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / run.duration_s, 2),
        "tpot_p50_s": round(tpot["median"], 4),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        # Tokens produced per decode step: 1 without drafts.
        "tokens_per_decode_step": round((num_tokens - len(outputs)) / max(1, len(decode_steps)), 2),
        "token_ids": [o.token_ids for o in outputs],
    }


def build_parser() -> argparse.ArgumentParser:
    # Not flags: the benchmark runs drafts off, then n-gram, at batch 1 (max_num_seqs=1).
    p = bench_parser(__doc__, exclude=("speculative_method", "max_num_seqs"))
    p.add_argument("--output-len", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args, max_num_seqs=1)

    off = measure(config.replace(speculative_method="off"), args.output_len)
    on = measure(config.replace(speculative_method="ngram"), args.output_len)
    a, b = off.pop("token_ids"), on.pop("token_ids")
    report = {
        "workload": {
            "num_requests": len(PROMPTS),
            "output_len": args.output_len,
            "arrivals": "one at a time",
            "greedy": True,
        },
        "runs": [off, on],
        "requests_with_same_tokens": sum(x == y for x, y in zip(a, b, strict=True)),
        "output_tokens_per_s_speedup": round(
            on["output_tokens_per_s"] / off["output_tokens_per_s"], 2
        ),
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
