"""bf16 linears on CPU: our kernel on oneDNN's packed weight vs oneDNN's own call, per row count.

    python -m benchmarks.packed_linear                      # SmolLM2-135M's 30 layers
    python -m benchmarks.packed_linear --rows 1 4 64 --layers 4

The model's decoder linears (q/k/v, o, gate/up, down; random bfloat16 weights, --layers of
them, so a call streams their weights from memory as a decode step does) are packed once for
oneDNN (engine/runner/models/prepack.py). For each number of rows M, one pass over all of them
is timed two ways, interleaved run by run: packed_bf16_linear (kernels/cpu_fused_ops.cpp: the
vdpbf16ps kernel for few rows, AMX tiles from 5 rows where the CPU has them, reading the
packed bytes in place) and torch.ops.mkldnn._linear_pointwise (oneDNN's GEMM on the same
packed weight: what the engine calls above packed_gemv_max_rows). Prints JSON: min and median
ms per pass and the ratio of the mins. Shapes whose packed layout the kernel cannot read are
left out (and listed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import emit
from engine.runner.models.prepack import (
    cpu_has_amx,
    packed_gemv_max_rows,
    packed_layout_matches,
)
from engine.runner.models.presets import MODEL_PRESETS
from kernels import cpu_fused_ops


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(MODEL_PRESETS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 64, 128, 256, 512])
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        raise SystemExit(f"the C++ kernels are unavailable: {why}")
    arch = MODEL_PRESETS[args.preset]
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    shapes = {
        "qkv": ((arch.num_heads + 2 * arch.num_kv_heads) * d, h),
        "o": (h, arch.num_heads * d),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
    }
    readable = {k: s for k, s in shapes.items() if packed_layout_matches(*s, torch.bfloat16)}
    gen = torch.Generator().manual_seed(args.seed)
    weights = []  # (packed tensor, its address, N, K) per layer and shape
    for _ in range(args.layers or arch.num_layers):
        for n, k in readable.values():
            w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            weights.append((packed, torch.ops.mkldnn.data_ptr(packed), n, k))

    def pass_of(rows: int, ours: bool) -> Callable[[], float]:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, _, _, k in weights}

        def run() -> float:
            start = time.perf_counter()
            for packed, address, n, k in weights:
                if ours:
                    cpu_fused_ops.packed_bf16_linear(xs[k], address, n, k)
                else:
                    torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
            return (time.perf_counter() - start) * 1e3

        return run

    results = {}
    for rows in args.rows:
        ours, onednn = pass_of(rows, True), pass_of(rows, False)
        ours(), onednn()  # warm-up: oneDNN builds a primitive per new shape
        times: dict[str, list[float]] = {"kernel": [], "onednn": []}
        for _ in range(args.repeats):
            times["kernel"].append(ours())
            times["onednn"].append(onednn())
        results[str(rows)] = {
            **{f"{k}_min_ms": round(min(v), 3) for k, v in times.items()},
            **{f"{k}_median_ms": round(statistics.median(v), 3) for k, v in times.items()},
            "kernel_over_onednn": round(min(times["kernel"]) / min(times["onednn"]), 3),
        }
    report = {
        "benchmark": "packed_linear",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "preset": args.preset,
        "threads": torch.get_num_threads(),
        "amx_cpu": cpu_has_amx(),
        "amx_tiles_in_kernel": cpu_fused_ops.has_amx_linear(),
        "engine_kernel_max_rows": packed_gemv_max_rows(cpu_fused_ops),
        "shapes": {k: list(s) for k, s in readable.items()},
        "shapes_left_out": sorted(set(shapes) - set(readable)),
        "weight_bytes_per_pass": sum(n * k * 2 for _, _, n, k in weights),
        "per_rows": results,
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
