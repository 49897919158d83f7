"""The weight-only GEMM part of scripts/gpu_check.py: the Triton W4A16 / W8A16 kernels
(kernels/w4a16_gemm.py, w8a16_gemm.py) on real layer shapes, checked against their float32
references and timed against (a) the weight-bytes floor (the quantized weight's bytes over the
measured copy bandwidth: at few rows the weight is what a GEMM must read), (b) dequantize +
16-bit matmul, the path the engine takes from CUDA_DEQUANT_MIN_ROWS rows up, and (c) the 16-bit
matmul of the unquantized weight. The rows say where the kernel beats (b), i.e. where the
engine's row threshold belongs on this GPU.
"""

from __future__ import annotations

# (name, N, K): SmolLM2-135M's gate/up and Llama-3-8B's gate/up and down projections.
GPU_SHAPES = (("smollm2 gate_up", 3072, 576), ("llama3-8b gate_up", 28672, 4096),
              ("llama3-8b down", 4096, 14336))  # fmt: skip
GPU_ROWS = (1, 16, 64, 256)
CPU_SHAPES = (("tiny", 128, 256),)
CPU_ROWS = (1, 5)
TOLERANCE_OF_MAX = {"float32": 1e-4, "bfloat16": 2e-2}


def weight_only_rows(torch, device, bandwidth: float | None, cpu: bool) -> list[dict]:
    """One row per (format, shape, rows): correctness, and on a GPU the timings."""
    from engine.runner.quant.formats import quantize_int4, quantize_int8
    from engine.runner.quant.linear import DequantScratch, Int4Linear, Int8Linear

    dtype = torch.float32 if cpu else torch.bfloat16
    rows = []
    for name, n, k in CPU_SHAPES if cpu else GPU_SHAPES:
        gen = torch.Generator().manual_seed(n)
        w = torch.randn(n, k, generator=gen) * 0.02
        scratch = DequantScratch(n * k, dtype, device)
        layers = {
            "w8a16": Int8Linear(quantize_int8(w), None, dtype, scratch, 1 << 30).to(device),
            "w4a16": Int4Linear(quantize_int4(w, 64), None, dtype, scratch, 1 << 30).to(device),
        }
        w16 = w.to(dtype).to(device)
        for fmt, layer in layers.items():
            layer.weight_only_kernel = "triton"
            ref_w = layer.dequantized_weight()
            for m in CPU_ROWS if cpu else GPU_ROWS:
                x = torch.randn(m, k, generator=gen).to(dtype).to(device)
                y = layer.weight_only_mm(x)
                ref = x.float() @ ref_w.t()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                row = {"check": fmt, "case": f"{name} M={m} ({n}x{k})", "dtype": str(dtype)[6:],
                       "max_err": f"{err:.1e}", "ok": err <= TOLERANCE_OF_MAX[str(dtype)[6:]]}  # fmt: skip
                if bandwidth:
                    _time(torch, row, layer, x, w16, bandwidth)
                rows.append(row)
    return rows


def _time(torch, row: dict, layer, x, w16, bandwidth: float) -> None:
    import triton.testing

    def bench_us(fn) -> float:
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    row["time_us"] = bench_us(lambda: layer.weight_only_mm(x))
    row["floor_us"] = 1e6 * layer.weight_bytes / bandwidth
    row["pct_floor"] = 100 * row["floor_us"] / row["time_us"]
    row["ref_us"] = bench_us(lambda: layer.dequant_mm(x))  # the engine's many-row path
    bf16_us = bench_us(lambda: torch.nn.functional.linear(x, w16))
    faster = "kernel" if row["time_us"] < row["ref_us"] else "dequant+GEMM"
    row["note"] = f"16-bit matmul {bf16_us:.0f} us; faster here: {faster}"
