"""Sampling a batch of next tokens: the engine's sampler vs the plain torch way, per row count.

    python -m benchmarks.sampling                          # 1, 8, 64 rows of a 49152 vocabulary
    python -m benchmarks.sampling --rows 64 --repeats 20

Greedy rows: the LM head's bfloat16 logits, argmax through the engine's CPU layer ops (a C++
op over the 16-bit rows) against widening them to float32 and torch.argmax. Sampled rows: the
plain way (as the engine did until 2026-12-05, and as a first torch version is written):
softmax, a full descending sort of every row when a top-k / top-p filters, then torch.multinomial per row
with the request's generator. The engine's torch path (engine/runner/sampler.py,
`engine_torch_path`): top-k / top-p ranked from torch.topk's largest TOP_CANDIDATES (a row
whose top-p prefix reaches past them sorted whole), and one uniform per row for an inverse
transform draw. The engine's (`engine`): the same in one fused C++ op per batch where the CPU
layer ops have it (kernels/cpu_sample_rows.h), else the torch path. All give each row the same
distribution (tests/test_sampler.py, tests/test_sample_rows.py); this times them, interleaved
repeat by repeat, on
language-model-shaped logits: a power law over a random order of the vocabulary (the k-th most
likely token ~ k^-1.1, top-1 ~0.2 at temperature 1) plus noise, seeded. Prints JSON: min and
median ms per batch, the ratios of the mins (plain over engine: speedup; torch path over the
fused op: fused_op_speedup), and the logits' shape (mean top-1 probability and
mass of the TOP_CANDIDATES most likely tokens at temperature 0.7).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import emit
from engine.request import SamplingParams
from engine.runner import sampler
from engine.runner.host_memory import keep_freed_memory
from engine.runner.models.layer_ops import TorchOps, make_layer_ops
from engine.runner.models.presets import MODEL_PRESETS

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50),
    "top-k 40 + top-p 0.95": SamplingParams(temperature=0.8, top_k=40, top_p=0.95),
}


def reference_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """sampler.logits_to_probs' filtering with a full sort of every row: the definition the
    engine's candidate ranking must reproduce."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    probs = probs.masked_fill(probs < threshold, 0.0)
    if not bool(((top_k > 0) | (top_p < 1.0)).any()):
        return probs / probs.sum(dim=-1, keepdim=True)
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(1)
    drop = ranks >= k
    kept = sorted_probs.masked_fill(drop, 0.0)
    mass_before = kept.cumsum(dim=-1) - kept
    drop |= mass_before >= top_p.unsqueeze(1) * kept.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(dim=-1, keepdim=True)


def reference_sample(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> list[int]:
    if params.greedy:
        return logits.float().argmax(dim=-1).tolist()
    rows = logits.shape[0]
    probs = reference_probs(
        logits,
        torch.full((rows,), params.temperature),
        torch.full((rows,), params.top_k),
        torch.full((rows,), params.top_p),
        torch.full((rows,), params.min_p),
    )
    return [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(generators)]


def lm_shaped_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Power-law probabilities (rank k ~ k^-1.1) over a random order of the vocabulary, with
    noise: peaked like a language model's next-token distribution."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(rows, vocab)
    for r in range(rows):
        order = torch.randperm(vocab, generator=gen)
        out[r, order] = -1.1 * ranks.log() + 0.3 * torch.randn(vocab, generator=gen)
    return out


def time_case(
    logits: torch.Tensor, params: SamplingParams, repeats: int, seed: int, ops: TorchOps
) -> dict:
    """The samplers on the same rows and seeded generators, interleaved repeat by repeat:
    the engine's (its fused op where the layer ops have one), the engine's torch path, and the
    plain torch way."""
    rows = logits.shape[0]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(rows)]
    runs: dict[str, Callable[[], object]] = {
        "engine": lambda: sampler.sample(
            logits, [params] * rows, gens, argmax=ops.argmax_rows, sample_rows=ops.sample_rows
        ),
        "engine_torch_path": lambda: sampler.sample(
            logits, [params] * rows, gens, argmax=ops.argmax_rows
        ),
        "plain_torch": lambda: reference_sample(logits, params, gens),
    }
    if params.greedy or ops.sample_rows is None:
        del runs["engine_torch_path"]  # the same code as "engine"
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {
        **{f"{k}_min_ms": round(min(v), 3) for k, v in times.items()},
        **{f"{k}_median_ms": round(statistics.median(v), 3) for k, v in times.items()},
        "speedup": round(min(times["plain_torch"]) / min(times["engine"]), 1),
        **(
            {"fused_op_speedup": round(min(times["engine_torch_path"]) / min(times["engine"]), 2)}
            if "engine_torch_path" in times
            else {}
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="glibc's own malloc thresholds (the before): by default the benchmark "
                        "sets the ones a CPU engine runs with (host_memory.keep_freed_memory)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # As in a CPU engine, a batch's freed [rows, vocab] temporaries stay for the next batch.
    kept = False if args.malloc_defaults else keep_freed_memory()
    ops, why_not = make_layer_ops(True, torch.device("cpu"), MODEL_PRESETS["smollm2-135m"])
    results: dict[str, dict] = {}
    shape: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        logits = lm_shaped_logits(rows, args.vocab, args.seed + rows)
        probs = torch.softmax(logits / 0.7, dim=-1)
        width = min(args.vocab, sampler.TOP_CANDIDATES)
        shape[f"{rows} rows"] = {
            "top1_mean": round(float(probs.max(dim=-1).values.mean()), 3),
            "top_candidates_mass_mean": round(float(probs.topk(width).values.sum(-1).mean()), 3),
        }
        for name, params in MODES.items():
            # Greedy rows see the LM head's bfloat16 output as it is; the others widen it.
            rows_in = logits.bfloat16() if params.greedy else logits
            results[f"{rows} rows, {name}"] = time_case(
                rows_in, params, args.repeats, args.seed, ops
            )
    report = {
        "benchmark": "sampling",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": torch.get_num_threads(),
        "freed_memory_kept": kept,
        "vocab": args.vocab,
        "top_candidates": sampler.TOP_CANDIDATES,
        "greedy_argmax": ops.name if why_not is None else f"torch ({why_not})",
        "sampled_rows": "fused op" if ops.sample_rows is not None else "torch path",
        "logits_at_temperature_0.7": shape,
        "per_case": results,
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
