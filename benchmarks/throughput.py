"""Throughput benchmark: our engine (continuous + paged, and static) vs HF `generate`.

    python -m benchmarks.throughput                   # the seeded 64-request workload, bfloat16
    python -m benchmarks.throughput --num-requests 16 --output-len 8 64 --json results/bench.json

One process runs (a) our engine with continuous batching and paged KV, (b) our engine with
static batching, (c) Hugging Face transformers `generate` with static batches (left-padded,
each batch runs until its longest request is done), (d) Hugging Face's own continuous batching
(transformers' `init_continuous_batching` manager: paged cache, sdpa attention), its cache
sized to hold the whole workload and its token budget per step set to ours. Every request has
an exact output length (ignore_eos), greedy. Each engine gets one warm-up request first, and
start-up (model load, cache allocation) is outside the timed window. Prints JSON: output tokens/s, TTFT and TPOT p50/p99, and the ratios.
The roofline bound divides by the device ceilings measured at the start of the run and again
right after each of our engine's runs, each ceiling's best (--cached-ceilings: the cached ones).
Arrivals: all requests are submitted at t=0, so TTFT includes queueing behind earlier work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (
    add_ceilings_flag,
    bench_parser,
    config_report,
    emit,
    end_of_run_ceilings,
    run_ceilings,
)
from engine.cli import config_from_args
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.telemetry.ceilings import get_ceilings, roofline_bound_s
from engine.telemetry.stats import StepStats, latency_summary

# How long HF's manager may go without finishing a request before the run is declared stuck.
HF_RESULT_TIMEOUT_S = 900.0

# Steps the benchmark's engine keeps (StepStats are small): the whole run, for its bound.
STEPS_KEPT = 1 << 16


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.workload_seed)
    # Ids above the special tokens and below the vocab size: plain text tokens.
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    return Workload(prompts, outputs)


def summarize(name: str, duration_s: float, num_tokens: int, ttfts: list[float],
              tpots: list[float], config: dict) -> dict:  # fmt: skip
    ttft, tpot = latency_summary(ttfts), latency_summary(tpots)
    return {
        "name": name,
        "config": config,
        "duration_s": round(duration_s, 3),
        "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / duration_s, 2),
        "ttft_p50_s": _round(ttft["median"]),
        "ttft_p99_s": _round(ttft["p99"]),
        "tpot_p50_s": _round(tpot["median"]),
        "tpot_p99_s": _round(tpot["p99"]),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_ours(
    config: EngineConfig, workload: Workload, args: argparse.Namespace
) -> tuple[dict, Path | None, str]:
    """One run of our engine; also returns the weights folder and the resolved dtype (for HF).
    Its roofline bound divides by the best of the ceilings measured before and after it."""
    # Every step of the run is kept (the ring buffer's default 2,048 can be too few) for the
    # roofline bound below.
    config = config.replace(step_history_len=max(config.step_history_len, STEPS_KEPT))
    llm = LLM(**dataclasses.asdict(config))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload.output_lens]  # fmt: skip
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    first_step = llm.engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    duration = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == workload.output_lens
    result = summarize(
        f"ours_{config.batching}", duration, sum(len(o.token_ids) for o in outs),
        [o.metrics.ttft_s for o in outs], [t for o in outs if (t := o.metrics.tpot_s)],
        {**config_report(config), "num_kv_blocks": llm.stats().num_kv_blocks},
    )  # fmt: skip
    result["num_preemptions"] = llm.stats().num_preemptions_total
    steps = [s for s in llm.stats().steps if s.step_index >= first_step]
    weights_dir = llm.engine.source.weights_dir
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    if len(steps) == llm.engine.num_steps - first_step:
        # The compute roof of what the matmuls multiply ("int8" with int8 activations).
        roof = llm.engine.runner.matmul_dtype
        end_of_run_ceilings(args, config.device)  # roofline_report reads them from the cache
        result["roofline"] = roofline_report(steps, str(llm.engine.runner.device), roof, duration)
    del llm
    gc.collect()
    return result, weights_dir, dtype


def roofline_report(steps: list[StepStats], device: str, dtype: str, duration_s: float) -> dict:
    """The run's roofline bound on this machine: every step at its roof from the measured
    ceilings (FLOPs at peak, bytes at bandwidth; engine/telemetry/ceilings.py), summed; and the
    fraction of that bound the run achieved (bound / measured wall time), which unlike a tok/s
    figure does not depend on which CPU ran it."""
    ceilings = get_ceilings(device)
    bound_s = roofline_bound_s(ceilings, dtype, ((s.flops, s.bytes_moved) for s in steps))
    by_kind = {}  # where the run's time went against its bound: decode vs mixed / prefill steps
    for kind in sorted({s.kind for s in steps}):
        of_kind = [s for s in steps if s.kind == kind]
        kind_s = sum(s.duration_s for s in of_kind)
        kind_bound_s = roofline_bound_s(
            ceilings, dtype, ((s.flops, s.bytes_moved) for s in of_kind)
        )
        by_kind[kind] = {
            "steps": len(of_kind),
            "time_s": round(kind_s, 3),
            "bound_s": round(kind_bound_s, 3),
            "fraction_of_bound": round(kind_bound_s / kind_s, 3) if kind_s else None,
        }
    decode = by_kind.get("decode", {"steps": 0, "bound_s": 0.0, "fraction_of_bound": None})
    return {
        "device": ceilings.name,
        "peak_flops_per_s": ceilings.peak(dtype),
        "peak_dtype": dtype,
        "bandwidth_bytes_per_s": ceilings.bandwidth_bytes_per_s,
        "num_steps": len(steps),
        "bound_s": round(bound_s, 3),
        "fraction_of_bound": round(bound_s / duration_s, 3),
        "decode_steps": decode["steps"],
        "decode_bound_s": decode["bound_s"],
        "decode_fraction_of_bound": decode["fraction_of_bound"],
        "by_step_kind": by_kind,
    }


class StepClock:
    """A logits processor that only records when each generation step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf(
    args: argparse.Namespace, workload: Workload, weights_dir: Path, dtype_name: str
) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=dtype).eval()
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else (pad_id or 0)
    ttfts, tpots = [], []
    total = 0
    start = time.perf_counter()
    for b in range(0, len(workload.prompts), args.hf_batch):
        prompts = workload.prompts[b : b + args.hf_batch]
        lens = workload.output_lens[b : b + args.hf_batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = StepClock()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]),
            )  # fmt: skip
        for n in lens:
            # Token k of every row appears at step k; a request is done at its own length.
            ttfts.append(clock.times[0] - start)
            if n > 1:
                tpots.append((clock.times[n - 1] - clock.times[0]) / (n - 1))
            total += n
    duration = time.perf_counter() - start
    return summarize(
        "hf_static", duration, total, ttfts, tpots,
        {"dtype": dtype_name, "batch_size": args.hf_batch, "library": "transformers"},
    )  # fmt: skip


def run_hf_continuous(
    workload: Workload, weights_dir: Path, dtype_name: str, config: EngineConfig
) -> dict:
    """Hugging Face's continuous batching on the same workload: every request submitted at
    t=0 with its exact length; TTFT and TPOT from the manager's per-token timestamps."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(
        str(weights_dir), dtype=getattr(torch, dtype_name), attn_implementation="sdpa"
    ).eval()
    lens = workload.output_lens
    generation = GenerationConfig(max_new_tokens=max(lens), do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)  # fmt: skip
    # Left to itself the manager sizes its cache from free memory (14 GB and ~25 s of set-up
    # on a 24 GiB machine); one page per 256 tokens of each request holds the whole workload.
    page_size = 256
    num_pages = sum(
        -(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, lens, strict=True)
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_pages + 2,
        max_batch_tokens=config.max_num_batched_tokens,
    )  # fmt: skip
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                          max_generated_length=max(lens), num_requests=len(lens))  # fmt: skip
    with torch.inference_mode():  # the manager's thread inherits the caller's mode
        manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb_config,
            workload_hints=hints,
        )  # fmt: skip
        manager.start()
        try:
            manager.add_request([1, 2, 3, 4], max_new_tokens=2)  # warm-up, as for ours
            _hf_result(manager)
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True)
                   for p, n in zip(workload.prompts, lens, strict=True)]  # fmt: skip
            results = {}
            while len(results) < len(ids):
                result = _hf_result(manager)
                results[result.request_id] = result
            duration = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=30)
    outs = [results[i] for i in ids]
    assert [len(o.generated_tokens) for o in outs] == lens
    ttfts = [o.timestamps[0] - start for o in outs]
    tpots = [
        (o.timestamps[-1] - o.timestamps[0]) / (n - 1)
        for o, n in zip(outs, lens, strict=True)
        if n > 1
    ]
    return summarize(
        "hf_continuous", duration, sum(lens), ttfts, tpots,
        {"dtype": dtype_name, "library": "transformers", "attention": "sdpa",
         "page_size": page_size, "num_blocks": num_pages + 2,
         "max_batch_tokens": config.max_num_batched_tokens},
    )  # fmt: skip


def _hf_result(manager):
    """The next finished request, or a RuntimeError (never a hang) when the manager stalls."""
    result = manager.get_result(timeout=HF_RESULT_TIMEOUT_S)
    if result is None or result.error:
        raise RuntimeError(f"transformers' continuous batching failed: {result and result.error}")
    return result


def build_parser() -> argparse.ArgumentParser:
    # --batching is not a flag: the benchmark runs continuous, then static (--static-batch).
    p = bench_parser(__doc__, exclude=("batching",))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--static-batch", type=int, default=8, help="our static mode's batch size")
    p.add_argument("--hf-batch", type=int, default=8, help="HF generate's batch size")
    p.add_argument("--skip", nargs="*", default=[], choices=["static", "hf", "hf_continuous"])
    # dest apart from EngineConfig.seed, which config_from_args would take it for.
    p.add_argument("--seed", dest="workload_seed", type=int, default=0, help="seeds the workload")
    add_ceilings_flag(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    config = config_from_args(args, batching="continuous")
    run_ceilings(args, config.device)  # measured now, and again after each of our runs
    results = {}
    workload = make_workload(args, _vocab_size(config.model))
    results["continuous"], weights_dir, dtype = run_ours(config, workload, args)
    if "static" not in args.skip:
        static = config.replace(batching="static", max_num_seqs=args.static_batch)
        results["static"], _, _ = run_ours(static, workload, args)
    if "hf" not in args.skip and weights_dir is not None:
        results["hf_static"] = run_hf(args, workload, weights_dir, dtype)
    if "hf_continuous" not in args.skip and weights_dir is not None:
        results["hf_continuous"] = run_hf_continuous(workload, weights_dir, dtype, config)
    cont = results["continuous"]["output_tokens_per_s"]
    report = {
        "benchmark": "benchmarks.throughput",
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "seed": args.workload_seed,
            "arrivals": "all at t=0",
            "output_tokens": workload.num_output_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        "results": results,
        "ratios": {
            f"continuous_vs_{k}": round(cont / v["output_tokens_per_s"], 2)
            for k, v in results.items()
            if k != "continuous"
        },
    }
    emit(report, args.json)
    return report


def _vocab_size(model: str) -> int:
    from engine.runner.model_loader import resolve_model

    return resolve_model(model).arch.vocab_size


if __name__ == "__main__":
    main(sys.argv[1:])
