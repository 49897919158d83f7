"""Quantization benchmark: none vs int8 vs int4 vs awq (and each with int8 activations, "+a8")
on one model, in one run.

    python -m benchmarks.quant                         # the embedded SmolLM2-135M, bfloat16
    python -m benchmarks.quant --quantization-group-size 32 --output-len 16
    python -m benchmarks.quant --formats none,int4     # a model without an AWQ checkpoint

awq runs the embedded model's AutoAWQ checkpoint at --quantization-group-size (engine/quantize:
made once, 3-33 minutes measured on 2 CPU cores, if `make quantize` has not made it yet).

Every format's engine is built (same model, same seed; all loaded at once, each with its own KV
cache), then timed in --rounds rounds (medians reported, each round's values listed) in which
the engines take turns (steps_in_turn: BATCH64_STEPS_PER_TURN steps each at batch 64, a whole
request each at batch 1), so a shared host's drift within seconds lands on every format alike.
A turn's first step is not timed (the other engines' weights fill the caches); times are the
engines' own step durations. Measured four ways:
- weight bytes: the weights as stored (quantized values + scales + zeros; the embedding and the
  norms stay 16-bit), and the bytes the cost model says one step reads;
- batch-1 TPOT: 3 prompts, one at a time per engine, the median of their decode steps;
- batch-64 decode: 64 requests at once, output tokens per second of the median step among
  those that decoded all 64 (prefill excluded);
- greedy agreement with "none": for a fixed set of text prompts, the fraction of output
  positions whose greedy token equals the unquantized model's (a position after a divergence
  continues from a different prefix, so this also counts the divergence's consequences), and
  how many outputs are identical.
Every request has an exact output length (ignore_eos). Prints JSON. Timings are noisy when
other processes share the cores.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import sys
from dataclasses import dataclass

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.config import ANY_ROWS, EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.telemetry.stats import StepStats

# "+a8": the same weights with int8_activations (W8A8 / W4A8 from a few rows, CPUs with
# AVX512-VNNI).
FORMATS = ("none", "int8", "int4", "awq", "int8+a8", "int4+a8", "awq+a8")


def format_fields(name: str) -> dict:
    """A --formats entry as EngineConfig fields."""
    quantization, _, a8 = name.partition("+")
    return {"quantization": quantization, "int8_activations": a8 == "a8"}


BATCH_SIZE = 64

# Greedy agreement prompts: short, varied, plain text (no hub data set needed).
TEXT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "In 1969, Neil Armstrong",
    "Explain photosynthesis in one sentence:",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a land far away, there lived",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The most important rule of programming is",
    "A list of fruits: apple, banana,",
    "Paged attention stores the KV cache in fixed-size blocks so that",
]


def load(config: EngineConfig, prompt_len: int) -> tuple[LLM, list[list[int]]]:
    """The format's engine, warmed up, and its batch-64 prompts (the same for every format)."""
    llm = LLM(**dataclasses.asdict(config))
    vocab = llm.engine.source.arch.vocab_size
    rng = random.Random(0)
    batch = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(BATCH_SIZE)]
    # Warm-up at both batch shapes: oneDNN builds a primitive per new matmul shape.
    llm.generate(batch, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.generate(batch[:1], SamplingParams(max_tokens=3, ignore_eos=True))
    return llm, batch


# Steps each engine takes in a row at batch 64 before the next one takes its turn: a turn's
# first step is not timed (steps_in_turn), so the longer the turns the fewer steps are timed;
# the shorter, the less a drifting host can favour one format (turns of 8, a cycle of 4
# formats in ~2.6 s, left per-round ratios between 0.91 and 1.05; of 3, ~1 s).
BATCH64_STEPS_PER_TURN = 3


@dataclass
class Turns:
    steps: list[StepStats]  # every step the engine took
    warm: list[StepStats]  # those that did not open a turn


def steps_in_turn(engines: list[LLM], prompts: list[list[list[int]]], params: SamplingParams,
                  steps_per_turn: int) -> list[Turns]:  # fmt: skip
    """Engine i's prompts[i] added at once, then the engines take turns of `steps_per_turn`
    steps each until every request is done. A host whose speed drifts within seconds (a shared
    cloud CPU: one bf16 batch ran at 801 then 589 tok/s two rounds later) slows every format's
    steps alike this way, where batches run one after another got whichever moment was theirs
    (per-round ratios to bf16 moved from 0.77 to 1.35). A turn's first step finds the caches
    full of the other engines' weights, so it is left out of `warm`: interleaved one step each,
    an int4 engine's batch-1 step took 4.6-4.8 ms against 3.9-4.0 ms alone (its 75 MB of
    weights stay in this host's L3 from step to step), and batch-64 steps ~15 % longer."""
    firsts = [llm.engine.num_steps for llm in engines]
    for llm, batch in zip(engines, prompts, strict=True):
        for prompt in batch:
            llm.engine.add(llm.engine.make_request(prompt, params))
    opened: list[set[int]] = [set() for _ in engines]
    while busy := [i for i, llm in enumerate(engines) if llm.engine.has_unfinished()]:
        for i in busy:
            engine = engines[i].engine
            opened[i].add(engine.num_steps)
            for _ in range(steps_per_turn):
                if not engine.has_unfinished():
                    break
                engine.step_or_raise()
    turns = []
    for llm, first, cold in zip(engines, firsts, opened, strict=True):
        steps = [s for s in llm.stats().steps if s.step_index >= first]
        turns.append(Turns(steps, [s for s in steps if s.step_index not in cold]))
    return turns


def time_round(engines: list[tuple[LLM, list[list[int]]]], output_len: int) -> list[dict]:
    """One timing round, the formats' engines taking turns (steps_in_turn): batch-1 TPOT (3
    requests, each engine running one to its end per turn, the prompt's step warming the
    caches) and batch-64 decode (turns of BATCH64_STEPS_PER_TURN). Both from the median of the
    engine's own warm step durations (schedule to update, model included): one step that the
    host stalls for 50 ms would move a mean of ~100 batch-1 steps by 10 %."""
    llms = [llm for llm, _ in engines]
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    batch1: list[list[float]] = [[] for _ in engines]
    whole_request = output_len + 1  # its prompt's step and every decode step
    for i in range(3):
        turns = steps_in_turn(llms, [[batch[i]] for _, batch in engines], greedy, whole_request)
        for durations, own in zip(batch1, turns, strict=True):
            durations += [s.duration_s for s in own.warm if s.kind == "decode"]
    batch64 = steps_in_turn(llms, [batch for _, batch in engines], greedy, BATCH64_STEPS_PER_TURN)
    rounds = []
    for durations, own in zip(batch1, batch64, strict=True):
        full = [s for s in own.warm if s.kind == "decode" and s.num_decode_reqs == BATCH_SIZE]
        if not full or not durations:
            raise ValueError(f"--output-len {output_len}: no warm decode step left to time "
                             "(a turn's first step is not timed); ask for more tokens")  # fmt: skip
        rounds.append({
            "batch1_tpot_ms": statistics.median(durations) * 1e3,
            "batch64_decode_tokens_per_s": BATCH_SIZE / statistics.median(
                s.duration_s for s in full
            ),
            "batch64_decode_steps": len(full),
            "batch64_output_tokens_per_s": BATCH_SIZE * output_len
            / sum(s.duration_s for s in own.steps),
        })  # fmt: skip
    return rounds


def dequant_rows(rows: int) -> int | str:
    return "never" if rows == ANY_ROWS else rows


def describe(llm: LLM, config: EngineConfig, rounds: list[dict], output_len: int) -> dict:
    """A format's report: its weights, the median of its rounds (each round's values listed
    too), and its greedy tokens on TEXT_PROMPTS (for agreement)."""
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    texts = llm.generate(TEXT_PROMPTS, greedy)
    runner = llm.engine.runner
    summary = runner.quant_summary

    def median(key: str, digits: int) -> float:
        return round(statistics.median(r[key] for r in rounds), digits)

    return {
        "quantization": config.quantization,
        # W8A8 / W4A8 from this many rows (0: weight-only; int8_activations=False, or this
        # CPU lacks the kernel)
        "int8_activations_min_rows": summary.int8_activations_min_rows if summary else 0,
        "group_size": summary.group_size if summary else None,
        "weight_bytes": runner.weight_bytes,
        "linear_bytes_per_param": round(runner.linear_bytes_per_param or runner.dtype.itemsize, 4),
        "bytes_read_per_step": int(llm.engine.shape.weight_bytes),
        # From this many rows dequantize + 16-bit GEMM ("never": int8 activations, the C++
        # kernel takes every row count)
        "dequant_min_rows": dequant_rows(summary.dequant_min_rows) if summary else None,
        "batch1_tpot_ms": median("batch1_tpot_ms", 2),
        "batch64_decode_tokens_per_s": median("batch64_decode_tokens_per_s", 1),
        "batch64_decode_steps": rounds[-1]["batch64_decode_steps"],
        "batch64_output_tokens_per_s": median("batch64_output_tokens_per_s", 1),
        "rounds": {
            "batch1_tpot_ms": [round(r["batch1_tpot_ms"], 2) for r in rounds],
            "batch64_decode_tokens_per_s": [
                round(r["batch64_decode_tokens_per_s"], 1) for r in rounds
            ],
        },
        "token_ids": [o.token_ids for o in texts],
    }


def agreement(runs: list[dict]) -> None:
    """Adds greedy agreement with the first run ("none") to every run, in place."""
    base = runs[0]["token_ids"]
    for run in runs:
        ids = run.pop("token_ids")
        same = sum(
            a == b for x, y in zip(ids, base, strict=True) for a, b in zip(x, y, strict=True)
        )
        run["greedy_token_agreement"] = round(same / sum(len(x) for x in base), 3)
        run["greedy_identical_outputs"] = sum(x == y for x, y in zip(ids, base, strict=True))


def build_parser():
    # Not flags: the benchmark sets the format itself and runs batches of BATCH_SIZE.
    p = bench_parser(__doc__, exclude=("quantization", "int8_activations", "max_num_seqs"))
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=16, help="batch-64 prompt tokens")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timing rounds, the formats in turn each round (medians reported)",
    )
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma-separated, the first is the baseline (default: all)")  # fmt: skip
    return p


def parse_formats(text: str, model: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    if not formats or any(f not in FORMATS for f in formats):
        raise ValueError(f"--formats: choose from {', '.join(FORMATS)}; got {text!r}")
    if any(f.startswith("awq") for f in formats) and model.startswith("random:"):
        raise ValueError("--formats: awq needs real weights (the embedded model's checkpoint)")
    return formats


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args, max_num_seqs=BATCH_SIZE)
    try:
        formats = parse_formats(args.formats, config.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Every format's engine at once, then timing rounds in which the engines take their steps
    # in turn (steps_in_turn): the host's speed drifts by 15-25 % within minutes, and run one
    # after the other, the formats measured later got whatever the host was doing then.
    configs = [config.replace(**format_fields(f)) for f in formats]
    engines = [load(c, args.prompt_len) for c in configs]
    rounds: list[list[dict]] = [[] for _ in formats]
    for _ in range(args.rounds):
        try:
            measured = time_round(engines, args.output_len)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for results, result in zip(rounds, measured, strict=True):
            results.append(result)
    runs = [
        describe(llm, c, r, args.output_len)
        for (llm, _), c, r in zip(engines, configs, rounds, strict=True)
    ]
    del engines
    gc.collect()
    agreement(runs)
    base = runs[0]
    for run in runs:
        run["weight_bytes_vs_none"] = round(run["weight_bytes"] / base["weight_bytes"], 3)
        run["batch1_tpot_vs_none"] = round(run["batch1_tpot_ms"] / base["batch1_tpot_ms"], 2)
        run["batch64_decode_vs_none"] = round(
            run["batch64_decode_tokens_per_s"] / base["batch64_decode_tokens_per_s"], 2
        )
        # Round by round (the formats took turns within each): how much of a ratio is noise.
        run["rounds_vs_none"] = {
            key: [
                round(a / b, 2)
                for a, b in zip(run["rounds"][key], base["rounds"][key], strict=True)
            ]
            for key in ("batch1_tpot_ms", "batch64_decode_tokens_per_s")
        }
    report = {
        "model": config.model,
        "config": config_report(config.replace(quantization="none", int8_activations=False)),
        "workload": {
            "output_len": args.output_len,
            "batch1_requests": 3,
            "rounds": args.rounds,
            "batch64_prompt_len": args.prompt_len,
            "agreement_prompts": len(TEXT_PROMPTS),
            "greedy": True,
        },
        "runs": runs,
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
