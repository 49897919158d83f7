"""bf16 linears on CPU: our kernel on oneDNN's packed weight vs oneDNN's own call, per row count.

    python -m benchmarks.packed_linear                      # SmolLM2-135M's 30 layers
    python -m benchmarks.packed_linear --rows 1 4 64 --layers 4
    python -m benchmarks.packed_linear --rows 4 16 64 --quantized   # + int8 / int4 kernels

The model's decoder linears (q/k/v, o, gate/up, down; random bfloat16 weights, --layers of
them, so a call streams their weights from memory as a decode step does; with --lm-head also
the LM head once) are packed once for oneDNN (engine/runner/models/prepack.py) and, on CPUs
without AVX512-BF16 (where oneDNN keeps the plain layout), into the kernel's pairs layout as
the engine does. For each number of rows M, one pass over all of them is timed two ways,
interleaved run by run: packed_bf16_linear (kernels/cpu_fused_ops.cpp: the pairs kernel for
few rows, AMX tiles from 5 rows where the CPU has them, float32 tiles from 33 rows on CPUs
without AVX512-BF16, reading the packed bytes in place) and torch.ops.mkldnn._linear_pointwise
(oneDNN's GEMM on its packed weight: what the engine calls above packed_gemv_max_rows). With
--quantized, also the weight-only kernels the engine's int8 and int4 (group 64) layers call on
the same weights, quantized once (int8_linear and int4_linear; kernels/README.md), and with
int8 activations where the CPU has the kernel. Prints JSON: min and median ms per pass and
the ratios of the mins. Shapes the kernel cannot read are left out (and listed); if none is
left, it stops with an error instead of printing a report of nothing.
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
    own_pairs_layout,
    packed_gemv_max_rows,
    packed_layout_matches,
    pairs_layout,
)
from engine.runner.models.presets import MODEL_PRESETS
from engine.runner.quant.formats import quantize_int4, quantize_int8
from kernels import cpu_fused_ops
from kernels.int4_pack import pack_int4

INT4_GROUP = 64


def quantized_forms(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors Int8Linear and Int4Linear (engine/runner/quant/linear.py) hand the kernels."""
    q8 = quantize_int8(w)
    q4 = quantize_int4(w, INT4_GROUP)
    zf = (8 - q4.zeros.float()) * q4.scales  # the kernel's w = (q - 8) s + zf
    sz4 = torch.stack([q4.scales.t(), zf.t()], dim=-1).bfloat16().contiguous()
    return {"q8": q8.qweight, "s8": q8.scales.bfloat16(), "p4": pack_int4(q4.qweight), "sz4": sz4}


def kernel_layout(n: int, k: int) -> str | None:
    """Whose packed bytes packed_bf16_linear reads for a bf16 [n, k] weight here: "onednn"
    (its layout is the kernel's), "ours" (CPUs without AVX512-BF16: prepack.own_pairs_layout),
    or None (the engine leaves such a weight unpacked)."""
    if packed_layout_matches(n, k, torch.bfloat16):
        return "onednn"
    if own_pairs_layout(n, k, torch.bfloat16, cpu_fused_ops):
        return "ours"
    return None


def preset_shapes(preset: str, lm_head: bool = False) -> dict[str, tuple[int, int]]:
    """A decoder layer's fused weights [N, K] of the model preset (and its LM head)."""
    arch = MODEL_PRESETS[preset]
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    shapes = {
        "qkv": ((arch.num_heads + 2 * arch.num_kv_heads) * d, h),
        "o": (h, arch.num_heads * d),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
    }
    if lm_head:
        shapes["lm_head"] = (arch.vocab_size, h)
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(MODEL_PRESETS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 64, 128, 256, 512])
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--lm-head", action="store_true",
                   help="also the LM head [vocab, hidden] (once per pass, as in a step)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantized", action="store_true",
                   help="also time int8_linear, int4_linear (and with int8 activations)")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        raise SystemExit(f"the C++ kernels are unavailable: {why}")
    arch = MODEL_PRESETS[args.preset]
    shapes = preset_shapes(args.preset, args.lm_head)
    layouts = {k: kernel_layout(*s) for k, s in shapes.items()}
    readable = {k: s for k, s in shapes.items() if layouts[k] is not None}
    if not readable:
        raise SystemExit(
            f"packed_bf16_linear reads none of {args.preset}'s shapes on this CPU "
            "(oneDNN packs them otherwise and the engine keeps them unpacked): nothing to time"
        )
    gen = torch.Generator().manual_seed(args.seed)
    weights = []  # per layer and shape: N, K, the packed bf16 weights and the quantized forms
    decoder = [s for k, s in readable.items() if k != "lm_head"]
    layer_shapes = decoder * (args.layers or arch.num_layers)
    if "lm_head" in readable:  # once per pass, as in a step
        layer_shapes.append(readable["lm_head"])
    for n, k in layer_shapes:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        # The kernel reads oneDNN's bytes where they are in its layout, else ours (as the
        # engine's PrepackedLinear does on CPUs without AVX512-BF16).
        ours = pairs_layout(w) if kernel_layout(n, k) == "ours" else None
        address = ours.data_ptr() if ours is not None else torch.ops.mkldnn.data_ptr(onednn)
        layer = {"n": n, "k": k, "packed": onednn, "ours": ours, "address": address}
        if args.quantized:
            layer.update(quantized_forms(w))
        weights.append(layer)
    paths = ["kernel", "onednn"]
    if args.quantized:  # int4_linear needs AVX-512 with VBMI (aten's kernel serves elsewhere)
        paths += ["int8", "int4"] if cpu_fused_ops.has_int4_linear() else ["int8"]
        if cpu_fused_ops.has_int8_act_linear():  # int8 activations from 1 row (W8A8, W4A8)
            paths += ["int8_a8", "int4_a8"] if cpu_fused_ops.has_int4_linear() else ["int8_a8"]

    def pass_of(rows: int, path: str) -> Callable[[], float]:
        xs = {
            layer["k"]: torch.randn(rows, layer["k"], generator=gen).bfloat16() for layer in weights
        }
        calls = {
            "kernel": lambda x, w: cpu_fused_ops.packed_bf16_linear(
                x, w["address"], w["n"], w["k"]
            ),
            "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(
                x, w["packed"], None, "none", [], ""
            ),
            "int8": lambda x, w: cpu_fused_ops.int8_linear(x, w["q8"], w["s8"]),
            "int4": lambda x, w: cpu_fused_ops.int4_linear(x, w["p4"], w["sz4"], INT4_GROUP),
            "int8_a8": lambda x, w: cpu_fused_ops.int8_linear(x, w["q8"], w["s8"], 1),
            "int4_a8": lambda x, w: cpu_fused_ops.int4_linear(x, w["p4"], w["sz4"], INT4_GROUP, 1),
        }
        call = calls[path]

        def run() -> float:
            start = time.perf_counter()
            for layer in weights:
                call(xs[layer["k"]], layer)
            return (time.perf_counter() - start) * 1e3

        return run

    results = {}
    for rows in args.rows:
        runs = {path: pass_of(rows, path) for path in paths}
        for run in runs.values():
            run()  # warm-up: oneDNN builds a primitive per new shape
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path, run in runs.items():
                times[path].append(run())
        results[str(rows)] = {
            **{f"{k}_min_ms": round(min(v), 3) for k, v in times.items()},
            **{f"{k}_median_ms": round(statistics.median(v), 3) for k, v in times.items()},
            "kernel_over_onednn": round(min(times["kernel"]) / min(times["onednn"]), 3),
            **{
                f"{k}_over_kernel": round(min(times[k]) / min(times["kernel"]), 3)
                for k in paths[2:]
            },
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
        # whose bytes packed_bf16_linear reads: oneDNN's packed weight, or our pairs layout
        "layouts": {k: layouts[k] for k in readable},
        "shapes_left_out": sorted(set(shapes) - set(readable)),
        "weight_bytes_per_pass": sum(layer["n"] * layer["k"] * 2 for layer in weights),
        "paths": paths,
        "per_rows": results,
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
