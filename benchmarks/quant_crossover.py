"""Where a quantized layer should switch from the weight-only kernel to dequantize + GEMM.

    python -m benchmarks.quant_crossover                 # SmolLM2-135M's shapes, bfloat16
    python -m benchmarks.quant_crossover --rows 1 16 64 256 --repeats 10
    python -m benchmarks.quant_crossover --dequant torch   # the torch dequantization

For each format (int8, int4 g64) and each number of rows M, times one decoder layer's four
linears (q/k/v, o, gate/up, down of the preset's shape, random weights) and the LM head three
ways: the 16-bit matmul (the unquantized baseline), the CPU weight-only kernel, and
dequantize-into-scratch + 16-bit GEMM. Prints JSON with the median microseconds per call and,
per format, the smallest M from which dequantize + GEMM beats the kernel over the decoder
layer. `--dequant cpu` (the default) runs what the engine runs with fused_ops: the one-pass
C++ dequantization and, for int8, the C++ weight-only kernel (int8_linear)
(CPU_FUSED_DEQUANT_MIN_ROWS in engine/runner/quant/apply.py); `--dequant torch` the torch ops
and aten's kernels it uses without them (CPU_DEQUANT_MIN_ROWS).
Timings are noisy when other processes share the cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import emit
from engine.runner.models.presets import MODEL_PRESETS
from engine.runner.quant.formats import quantize_int4, quantize_int8
from engine.runner.quant.linear import DequantScratch, Int4Linear, Int8Linear, QuantLinear

GROUP_SIZE = 64


def layer_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's linears and of the LM head."""
    a = MODEL_PRESETS[preset]
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return {
        "qkv_proj": (q + 2 * kv, a.hidden_size),
        "o_proj": (a.hidden_size, q),
        "gate_up_proj": (2 * a.intermediate_size, a.hidden_size),
        "down_proj": (a.hidden_size, a.intermediate_size),
        "lm_head": (a.vocab_size, a.hidden_size),
    }


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: oneDNN builds its primitive for the shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def make_layers(shapes, dtype, kernels) -> dict[str, dict[str, QuantLinear | torch.Tensor]]:
    scratch_elements = max(n * k for name, (n, k) in shapes.items() if name != "lm_head")
    scratch = DequantScratch(scratch_elements, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    layers = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        layers[name] = {
            "bf16": w.to(dtype),
            "int8": Int8Linear(quantize_int8(w), None, dtype, scratch, 0),
            "int4": Int4Linear(quantize_int4(w, GROUP_SIZE), None, dtype, scratch, 0),
        }
        for fmt in ("int8", "int4"):
            layers[name][fmt].use_cpu_kernels(kernels)  # None: the torch dequantization
    return layers


def measure(layers, rows: list[int], repeats: int, dtype) -> list[dict]:
    results = []
    for m in rows:
        row: dict[str, float | int] = {"rows": m}
        for group, names in (
            ("layer", [n for n in layers if n != "lm_head"]),
            ("lm_head", ["lm_head"]),
        ):
            total = {"bf16": 0.0, "int8_kernel": 0.0, "int8_dequant": 0.0,
                     "int4_kernel": 0.0, "int4_dequant": 0.0}  # fmt: skip
            for name in names:
                k = layers[name]["bf16"].shape[1]
                x = torch.randn(m, k).to(dtype)
                w = layers[name]["bf16"]
                total["bf16"] += median_us(lambda x=x, w=w: F.linear(x, w), repeats)
                for fmt in ("int8", "int4"):
                    layer = layers[name][fmt]
                    total[f"{fmt}_kernel"] += median_us(
                        lambda x=x, q=layer: q.weight_only_mm(x), repeats
                    )
                    total[f"{fmt}_dequant"] += median_us(
                        lambda x=x, q=layer: q.dequant_mm(x), repeats
                    )
            row.update({f"{group}_{k}_us": round(v, 1) for k, v in total.items()})
        results.append(row)
    return results


def crossover_rows(results: list[dict], fmt: str) -> int | None:
    """Smallest M from which dequantize + GEMM is faster than the kernel for every larger M
    measured too (one noisy win does not move it); None if the kernel always wins."""
    best = None
    for row in reversed(results):
        if row[f"layer_{fmt}_dequant_us"] < row[f"layer_{fmt}_kernel_us"]:
            best = row["rows"]
        else:
            break
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(MODEL_PRESETS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 48, 64, 96, 128, 256])
    p.add_argument("--repeats", type=int, default=15, help="timed calls per measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument(
        "--dequant",
        choices=("cpu", "torch"),
        default="cpu",
        help="cpu: the one-pass C++ dequantization (fused_ops); torch: the torch ops",
    )
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    shapes = layer_shapes(args.preset)
    kernels = None
    if args.dequant == "cpu":
        from kernels import cpu_fused_ops

        cpu_fused_ops.load_extension()  # CpuKernelUnavailable (with the reason) without g++
        kernels = cpu_fused_ops  # the checked wrappers, as the engine's layers get them
    with torch.inference_mode():
        results = measure(make_layers(shapes, dtype, kernels), args.rows, args.repeats, dtype)
    emit(
        {
            "preset": args.preset,
            "dtype": "bfloat16",
            "int4_group_size": GROUP_SIZE,
            "torch_threads": torch.get_num_threads(),
            "dequant": args.dequant,
            "crossover_rows": {f: crossover_rows(results, f) for f in ("int8", "int4")},
            "results": results,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
