"""Speculative-decoding benchmark: off vs n-gram drafts vs a draft model, at several batch sizes.

    python -m benchmarks.spec                       # chat prompts, batch 1 4 16, all methods
    python -m benchmarks.spec --workload copy --batch-sizes 1 --methods off,ngram
    python -m benchmarks.spec --num-speculative-tokens 3 --json results/bench_spec.json

Workloads: "chat" asks ordinary questions through the model's chat template (what most users
send); "copy" asks to copy, continue a list or edit code (where n-gram drafts shine). Methods:
off, ngram (prompt lookup), draft-int4 / draft-int8 / draft (the draft model: the target's own
weights quantized to int4 / int8, or unquantized; --speculative-model picks another model).
At batch size b the requests go b at a time, each group after the previous one finished (b = 1:
one chat user; decode is latency-bound there, the case speculation is for). Greedy,
`ignore_eos`. Prints JSON per (method, batch): output tokens/s, TPOT p50, draft tokens verified
and accepted, acceptance by draft position, mean accepted length (tokens per verifying
request-step), the draft model's share of the time, and whether every request gave the same
tokens as without speculation (in bfloat16 a step computing k + 1 positions rounds differently
from one computing 1, so a near-tie can flip; in float32 they are identical, as tested).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.telemetry.stats import EngineStats, latency_summary

COPY_PROMPTS = [
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
PROMPTS = COPY_PROMPTS  # (the name tests and older scripts use)

# Ordinary chat: questions a playground user types, sent through the chat template.
CHAT_QUESTIONS = [
    "What are three tips for sleeping better?",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "How do I make a cup of green tea?",
    "What is the difference between weather and climate?",
    "Give me a few ideas for a rainy weekend.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What should I pack for a day of hiking?",
    "How does a bicycle stay upright?",
    "Describe your ideal breakfast.",
    "What are the benefits of learning a second language?",
    "Tell me a fun fact about octopuses.",
    "How can I be more productive when working from home?",
    "What is photosynthesis?",
    "Suggest a name for a friendly robot and explain why.",
]

METHODS = ("off", "ngram", "draft", "draft-int8", "draft-int4")


def method_config(config: EngineConfig, method: str) -> EngineConfig:
    """The engine settings of a method name: off, ngram, draft[-int8|-int4]."""
    if method not in METHODS:
        raise ValueError(f"methods: unknown method {method!r}; choose from {', '.join(METHODS)}")
    if method in ("off", "ngram"):
        return config.replace(speculative_method=method)
    fmt = method.partition("-")[2] or "none"
    return config.replace(speculative_method="draft", speculative_quantization=fmt)


def workload_prompts(llm: LLM, workload: str) -> list:
    if workload == "copy":
        return list(COPY_PROMPTS)
    if llm.engine.tokenizer is None or not getattr(llm.engine.tokenizer, "chat_template", None):
        return list(CHAT_QUESTIONS)  # a model without a chat template: the questions as text
    return [
        llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS
    ]


def run_groups(llm: LLM, prompts: list, params: SamplingParams, batch: int) -> tuple:
    """Send `batch` prompts at a time, each group after the previous one finished."""
    outputs = []
    first_step = llm.engine.num_steps
    before = llm.stats()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params)
    duration_s = time.perf_counter() - start
    after = llm.stats()
    steps = [s for s in after.steps if s.step_index >= first_step]
    return outputs, duration_s, steps, before, after


def measure(llm: LLM, method: str, prompts: list, batch: int, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs, duration_s, steps, before, after = run_groups(llm, prompts, params, batch)
    num_tokens = sum(len(o.token_ids) for o in outputs)
    tpot = latency_summary([t for o in outputs if (t := o.metrics.tpot_s)])
    drafts = after.num_draft_tokens_total - before.num_draft_tokens_total
    accepted = after.num_accepted_tokens_total - before.num_accepted_tokens_total
    proposals = after.num_spec_proposals_total - before.num_spec_proposals_total
    draft_s = sum(s.draft_duration_s for s in steps)
    verify_s = sum(s.verify_duration_s for s in steps)
    decode_steps = [s for s in steps if s.kind == "decode"]
    return {
        "method": method,
        "batch_size": batch,
        "num_requests": len(prompts),
        "duration_s": round(duration_s, 3),
        "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / duration_s, 2),
        "tpot_p50_s": round(tpot["median"], 4),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "acceptance_by_position": _by_position(before, after),
        "mean_accepted_length": round(1 + accepted / proposals, 2) if proposals else None,
        "draft_time_share": round(draft_s / duration_s, 3),
        "verify_time_share": round(verify_s / duration_s, 3),
        "decode_steps": len(decode_steps),
        "token_ids": [o.token_ids for o in outputs],
    }


def _by_position(before: EngineStats, after: EngineStats) -> list[float]:
    """Accepted / verified per draft position, over this run only."""
    width = len(after.num_draft_tokens_by_position)
    out = []
    for i in range(width):
        old = i < len(before.num_draft_tokens_by_position)
        drafts = after.num_draft_tokens_by_position[i] - (
            before.num_draft_tokens_by_position[i] if old else 0
        )
        accepted = after.num_accepted_tokens_by_position[i] - (
            before.num_accepted_tokens_by_position[i] if old else 0
        )
        out.append(round(accepted / drafts, 3) if drafts else 0.0)
    return out


def build_parser() -> argparse.ArgumentParser:
    # Not flags: the methods set speculative_method and the draft's weights; the batch sizes
    # set max_num_seqs.
    p = bench_parser(
        __doc__, exclude=("speculative_method", "speculative_quantization", "max_num_seqs")
    )
    p.add_argument("--workload", choices=("chat", "copy"), default="chat")
    p.add_argument("--methods", default="off,ngram,draft-int4,draft-int8",
                   help="comma-separated: " + ", ".join(METHODS))  # fmt: skip
    p.add_argument("--batch-sizes", default="1,4,16", help="comma-separated")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--requests-at-batch-1", type=int, default=4,
                   help="prompts sent one at a time at batch 1 (batch b > 1 sends b)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or methods[0] != "off":
        raise ValueError("methods: must start with off (the baseline the others compare to)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in batches):
        raise ValueError(f"batch_sizes: must be positive, got {args.batch_sizes!r}")
    config = config_from_args(args, max_num_seqs=max(batches))
    runs, baseline = [], {}
    for method in methods:
        llm = LLM(**dataclasses.asdict(method_config(config, method)))
        llm.generate([[101, 102, 103, 104]], SamplingParams(max_tokens=6))  # warm-up
        prompts = workload_prompts(llm, args.workload)
        for batch in batches:
            count = args.requests_at_batch_1 if batch == 1 else batch
            chosen = [prompts[i % len(prompts)] for i in range(count)]
            run = measure(llm, method, chosen, batch, args.output_len)
            tokens = run.pop("token_ids")
            if method == "off":
                baseline[batch] = (tokens, run["output_tokens_per_s"])
            base_tokens, base_rate = baseline[batch]
            run["requests_with_same_tokens"] = sum(
                a == b for a, b in zip(tokens, base_tokens, strict=True)
            )
            run["greedy_identical"] = tokens == base_tokens
            run["speedup"] = round(run["output_tokens_per_s"] / base_rate, 2)
            runs.append(run)
        del llm
        gc.collect()
    report = {
        "workload": {
            "name": args.workload,
            "output_len": args.output_len,
            "greedy": True,
            "batch_sizes": batches,
        },
        "model": config.model,
        "draft_model": config.speculative_model or config.model,
        "config": config_report(config),
        "runs": runs,
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
