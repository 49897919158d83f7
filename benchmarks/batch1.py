"""Batch-1 latency: our engine against Hugging Face `generate` and the bandwidth floor, in one run.

    python -m benchmarks.batch1                        # embedded SmolLM2-135M, bfloat16
    python -m benchmarks.batch1 --vary prepack_weights=true,false
    python -m benchmarks.batch1 --vary fused_ops=true,false
    python -m benchmarks.batch1 --vary quantization=none,int8,int4
    python -m benchmarks.batch1 --skip-hf --decode-step-ab 6 [--quantization int4]
    python -m benchmarks.batch1 --sampled --vary quantization=none,int4   # the Chat tab's settings

One user, one request at a time (a chat, an agent loop): each prompt (--prompt-len tokens) is
sent when the previous one has finished and generates exactly --output-len tokens, greedy;
with --sampled, at the Chat tab's default temperature and top-p (playground/handlers/chat.py),
request i seeded i in our engines and torch.manual_seed(i) before HF's (whose tokens then
differ from ours: another generator; `same_tokens_as_baseline` is null for it).
Measured per engine: TPOT (median over the prompts of each request's time per output token
after the first) and TTFT. Engines, in this order, each built afresh in this process:
- ours with the flags given, once per value of `--vary FIELD=V1,V2,...` (the first value is
  the baseline the others are compared with; e.g. prepack_weights=true,false: the oneDNN weight
  prepacking and its "before"; fused_ops=true,false: the C++ norm/RoPE/SiLU ops and theirs);
- Hugging Face transformers `generate` on the same weights and dtype (one request at a time).
The floor: a decode step reads every weight it multiplies by once (the cost model's bytes per
step, engine/telemetry/cost.py), so TPOT >= those bytes / bandwidth, with the bandwidth
measured at the start of the run and again at its end, the higher one (engine/telemetry/
ceilings.py; --cached-ceilings takes the cached one). Printed as JSON: each engine's
TPOT over the floor and over the baseline's TPOT, and whether its tokens equal the baseline's.
Timings are noisy when other processes share the cores: the load average is reported.
`--decode-step-ab N`: the one-call C++ decode step (engine/runner/models/decode_step.py) on and
off in one more engine of the first config, request by request over N rounds (interleaved, so
a slow spell of the machine hits both): the step's own share, which `--vary
enforce_eager=false,true` mixes with the layers' direct kernel calls.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import statistics
import sys
import time

import torch

from benchmarks.common import (
    add_ceilings_flag,
    bench_parser,
    config_report,
    emit,
    end_of_run_ceilings,
    parse_vary,
    run_ceilings,
    vary_configs,
)
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.runner.model_loader import resolve_model
from playground.handlers.chat import CHAT_TEMPERATURE, CHAT_TOP_P


def request_params(output_len: int, sampled: bool, index: int) -> SamplingParams:
    """Request `index`'s parameters: greedy, or the Chat tab's defaults seeded with the index
    (every engine of the run draws from the same seeds)."""
    if not sampled:
        return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=output_len, temperature=CHAT_TEMPERATURE, top_p=CHAT_TOP_P,
                          seed=index, ignore_eos=True)  # fmt: skip


def run_ours(
    config: EngineConfig, prompts: list[list[int]], output_len: int, sampled: bool = False
) -> dict:
    llm = LLM(**dataclasses.asdict(config))
    llm.generate([prompts[0][:8]], request_params(4, sampled, 0))  # warm-up, the same path
    outs = [
        llm.generate([p], request_params(output_len, sampled, i))[0] for i, p in enumerate(prompts)
    ]
    runner = llm.engine.runner
    result = {
        "tpot_ms": round(statistics.median(o.metrics.tpot_s for o in outs) * 1e3, 2),
        "ttft_ms": round(statistics.median(o.metrics.ttft_s for o in outs) * 1e3, 1),
        "weight_bytes_stored": runner.weight_bytes,
        "weight_bytes_read_per_step": round(llm.engine.shape.weight_bytes),
        "prepacked_linears": runner.num_prepacked_linears,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "token_ids": [o.token_ids for o in outs],
    }
    del llm
    gc.collect()
    return result


def run_decode_step_ab(
    config: EngineConfig,
    prompts: list[list[int]],
    output_len: int,
    rounds: int,
    sampled: bool = False,
) -> dict:
    """Median TPOT with the model's C++ decode step and with its Python layers (the step set
    aside), alternating per request."""
    llm = LLM(**dataclasses.asdict(config))
    model = llm.engine.runner.model
    step = model.decode_step
    if step is None:
        return {"skipped": "no C++ decode step in this configuration (see decode_step.py)"}
    llm.generate([prompts[0][:8]], request_params(4, sampled, 0))  # warm-up
    tpots: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {True: [], False: []}
    for _ in range(rounds):
        for i, prompt in enumerate(prompts):
            for on in (True, False):
                model.decode_step = step if on else None
                out = llm.generate([prompt], request_params(output_len, sampled, i))[0]
                tpots[on].append(out.metrics.tpot_s * 1e3)
                tokens[on].append(out.token_ids)
    model.decode_step = step
    del llm
    gc.collect()
    on_ms, off_ms = statistics.median(tpots[True]), statistics.median(tpots[False])
    return {
        "requests_each": len(tpots[True]),
        "step_tpot_ms": round(on_ms, 2),
        "layers_tpot_ms": round(off_ms, 2),
        "step_over_layers": round(on_ms / off_ms, 3),
        "step_faster_in_pairs": sum(a < b for a, b in zip(tpots[True], tpots[False], strict=True)),
        "same_tokens": tokens[True] == tokens[False],
    }


def hf_sampling_kwargs(sampled: bool) -> dict:
    """`generate` arguments for the same sampling as request_params. top_k=0 turns off the
    top-k of 50 that transformers applies by default, which our engine does not."""
    if not sampled:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P, "top_k": 0}


def run_hf(
    weights_dir,
    dtype: torch.dtype,
    prompts: list[list[int]],
    output_len: int,
    sampled: bool = False,
) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from benchmarks.throughput import StepClock

    model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=dtype).eval()
    sampling = hf_sampling_kwargs(sampled)
    tpots, ttfts, tokens = [], [], []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=4, **sampling)
        for i, p in enumerate(prompts):
            torch.manual_seed(i)
            clock = StepClock()
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=output_len, min_new_tokens=output_len,
                logits_processor=LogitsProcessorList([clock]), **sampling,
            )  # fmt: skip
            ttfts.append(clock.times[0] - start)
            tpots.append((clock.times[-1] - clock.times[0]) / (len(clock.times) - 1))
            tokens.append(out[0, len(p) :].tolist())
    return {
        "tpot_ms": round(statistics.median(tpots) * 1e3, 2),
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 1),
        "token_ids": tokens,
    }


def build_parser():
    p = bench_parser(__doc__)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--vary", default="prepack_weights=true,false",
                   help="FIELD=V1,V2,...: one engine per value, the first is the baseline")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--sampled", action="store_true",
                   help="sample at the Chat tab's default temperature and top-p, not greedy")  # fmt: skip
    p.add_argument("--decode-step-ab", type=int, default=0, metavar="ROUNDS",
                   help="also time the C++ decode step on/off, interleaved, over ROUNDS rounds")  # fmt: skip
    add_ceilings_flag(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    field, values = parse_vary(args.vary)
    configs = vary_configs(args, field, values)
    config = configs[0]
    ceilings = run_ceilings(args, config.device)  # before the engines: a quiet machine
    source = resolve_model(config.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, source.arch.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]  # fmt: skip
    runs: dict[str, dict] = {}
    for value, cfg in zip(values, configs, strict=True):
        runs[f"ours {field}={value}"] = run_ours(cfg, prompts, args.output_len, args.sampled)
    base = next(iter(runs.values()))
    if not args.skip_hf and source.weights_dir is not None:
        dtype = getattr(torch, base["dtype"])
        runs["hf generate"] = run_hf(
            source.weights_dir, dtype, prompts, args.output_len, args.sampled
        )
    ceilings = end_of_run_ceilings(args, config.device)  # the best of before and after
    bandwidth = ceilings.bandwidth_bytes_per_s
    base_tokens = base["token_ids"]
    for name, run in runs.items():
        same = run.pop("token_ids") == base_tokens
        # HF samples from its own generator: equal tokens would be chance, not agreement.
        run["same_tokens_as_baseline"] = None if args.sampled and name == "hf generate" else same
        read = run.get("weight_bytes_read_per_step", base["weight_bytes_read_per_step"])
        run["floor_tpot_ms"] = round(read / bandwidth * 1e3, 2)
        run["tpot_over_floor"] = round(run["tpot_ms"] / run["floor_tpot_ms"], 2)
        run["tpot_over_baseline"] = round(run["tpot_ms"] / base["tpot_ms"], 2)
    report = {
        "benchmark": "benchmarks.batch1",
        "date": time.strftime("%Y-%m-%d"),
        "device": ceilings.name,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "bandwidth_bytes_per_s": bandwidth,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "sampling": (
            {"temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P} if args.sampled else "greedy"
        ),
        "config": config_report(config),
        "vary": field,
        "runs": runs,
    }
    if args.decode_step_ab > 0:
        report["decode_step_ab"] = run_decode_step_ab(
            config, prompts, args.output_len, args.decode_step_ab, args.sampled
        )
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
