"""Registers, spills, shared memory and occupancy of the Triton kernels on a CUDA GPU, without one.

Calls each kernel's wrapper on meta tensors (shapes only), records the launch it makes (the
constexprs, num_warps and argument types the wrapper picked), compiles that launch for an
NVIDIA target offline with Triton's own compiler, and reads ptxas's resource report. The
numbers are facts about the compiled code, not timings: they say whether a launch spills
registers and how many programs fit on an SM, which is how the wrappers' launch choices
(decode_launch, prefill_launch) were made before a GPU was at hand.

    python scripts/kernel_resources.py                     # the wrappers' launches, sm_90
    python scripts/kernel_resources.py --sweep             # every tile x warps candidate
    python scripts/kernel_resources.py --arch 80 --json out.json

Needs Triton's bundled ptxas; no GPU, no driver. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Models whose attention shapes are compiled: keys of the engine's one preset table
# (engine/runner/models/presets.py), read in launches().
MODELS = ("llama-3-8b", "llama-2-7b", "smollm2-135m")
DTYPES = ("bfloat16", "float32")
SWEEP_TILES = (16, 32, 64)
SWEEP_WARPS = (4, 8)
# Per-SM limits of sm_80 / sm_90 (CUDA occupancy calculator): registers, shared memory.
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_BYTES_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SHARED_RESERVED_PER_PROGRAM = 1024


@dataclass
class Report:
    kernel: str
    choice: str  # "wrapper" (the launch the wrapper makes) or "sweep" (a candidate)
    model: str
    dtype: str
    tile_tokens: int | None
    num_warps: int
    registers: int
    spill_bytes: int  # spill stores, bytes per thread
    shared_bytes: int
    programs_per_sm: int
    warps_per_sm: int
    kv_bytes_in_flight_per_sm: int | None  # attention kernels: programs x one K+V tile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version to compile for")
    parser.add_argument("--sweep", action="store_true", help="every tile x warps candidate")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    reports = []
    for model, dtype in itertools.product(args.models, args.dtypes):
        for launch in launches(model, dtype, args.sweep):
            report = compile_report(launch, args.arch)
            reports.append(report)
            print_row(report)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# Recording the wrappers' launches


@dataclass
class RecordedLaunch:
    kernel: object  # triton JITFunction
    name: str
    model: str
    dtype: str
    args: tuple
    kwargs: dict
    choice: str = "wrapper"  # "wrapper": what the wrapper picks; "sweep": a candidate


def launches(model: str, dtype_name: str, sweep: bool) -> list[RecordedLaunch]:
    """The launches the wrappers make for one model shape: kv_store, decode at batch 64 with
    2k contexts (partitions + reduce), prefill of 2k tokens. With sweep, decode and prefill
    once per tile x warps candidate."""
    import torch

    import kernels
    from engine.runner.models.presets import MODEL_PRESETS
    from kernels.paged_attention_decode import Launch

    arch = MODEL_PRESETS[model]
    num_heads, num_kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    dtype = getattr(torch, dtype_name)
    meta = {"dtype": dtype, "device": "meta"}  # shapes and strides only, no memory
    block_size, batch, context, prompt = 16, 64, 2048, 2048
    cache = torch.empty(4096, block_size, num_kv_heads, head_dim, **meta)
    key = torch.empty(prompt, num_kv_heads, head_dim, **meta)
    slots = torch.empty(prompt, dtype=torch.int64, device="meta")
    tables = torch.empty(batch, context // block_size, dtype=torch.int32, device="meta")
    seq_lens = torch.empty(batch, dtype=torch.int32, device="meta")
    decode_query = torch.empty(batch, num_heads, head_dim, **meta)
    prefill_query = torch.empty(prompt, num_heads, head_dim, **meta)
    one_table = torch.empty(1, prompt // block_size, dtype=torch.int32, device="meta")
    one_len = torch.empty(1, dtype=torch.int32, device="meta")
    start_loc = torch.empty(2, dtype=torch.int32, device="meta")

    def decode(launch: Launch | None) -> None:
        kernels.paged_attention_decode(
            decode_query, cache, cache, tables, seq_lens, 0.1, launch=launch
        )

    def prefill(launch: Launch | None) -> None:
        kernels.paged_attention_prefill(
            prefill_query, cache, cache, one_table, one_len, start_loc, 0.1, launch=launch
        )

    calls = [functools.partial(kernels.kv_store, key, key, cache, cache, slots)]
    calls += [functools.partial(decode, None), functools.partial(prefill, None)]
    calls += layer_calls(arch, dtype) if dtype != torch.float32 else []
    if sweep:
        for tile, warps in itertools.product(SWEEP_TILES, SWEEP_WARPS):
            calls += [functools.partial(decode, Launch(tile, warps))]
            calls += [functools.partial(prefill, Launch(tile, warps))]
    recorded: list[RecordedLaunch] = []
    with recording(recorded, model, dtype_name):
        for call in calls:
            before = len(recorded)
            call()
            if call.args and isinstance(call.args[0], Launch):
                # A swept candidate: keep its attention kernel, not the same reduce again.
                for launch in recorded[before:]:
                    launch.choice = "sweep"
                del recorded[before + 1 :]
    return recorded


def layer_calls(arch, dtype) -> list:
    """The fused per-layer ops (kernels/fused_ops_triton.py) at a decode step's 64 rows, and the
    weight-only GEMMs (w4a16, w8a16) at the MLP's gate/up shape for 1 and 64 rows: the
    launches the engine makes for a quantized 16-bit model on CUDA."""
    import torch

    from kernels import fused_ops_triton
    from kernels.w4a16_gemm import w4a16_gemm
    from kernels.w8a16_gemm import w8a16_gemm

    meta = {"dtype": dtype, "device": "meta"}
    rows, hidden, inter = 64, arch.hidden_size, arch.intermediate_size
    x, weight = torch.empty(rows, hidden, **meta), torch.empty(hidden, **meta)
    qkv = torch.empty(rows, (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, **meta)
    positions = torch.empty(rows, dtype=torch.int64, device="meta")
    table = torch.empty(4096, arch.head_dim // 2, dtype=torch.float32, device="meta")
    heads = arch.num_heads + arch.num_kv_heads
    calls = [
        functools.partial(fused_ops_triton.add_rms_norm, x, x, weight, 1e-5),
        functools.partial(
            fused_ops_triton.rope_, qkv, positions, table, table, heads, arch.head_dim
        ),
        functools.partial(fused_ops_triton.silu_mul, torch.empty(rows, 2 * inter, **meta)),
    ]
    packed = torch.empty(2 * inter, hidden // 2, dtype=torch.uint8, device="meta")
    sz = torch.empty(hidden // 64, 2 * inter, 2, **meta)
    q8 = torch.empty(2 * inter, hidden, dtype=torch.int8, device="meta")
    scales = torch.empty(2 * inter, **meta)
    for m in (1, 64):
        xm = torch.empty(m, hidden, **meta)
        calls += [functools.partial(w4a16_gemm, xm, packed, sz, 64)]
        calls += [functools.partial(w8a16_gemm, xm, q8, scales)]
    return calls


KERNEL_MODULES = ("kv_store", "paged_attention_decode", "paged_attention_prefill",
                  "fused_ops_triton", "w4a16_gemm", "w8a16_gemm")  # fmt: skip


class recording:
    """Swaps every kernel's `run` (what `kernel[grid](...)` calls) for a recorder."""

    def __init__(self, sink: list[RecordedLaunch], model: str, dtype: str) -> None:
        from triton.runtime.jit import JITFunction

        for module in KERNEL_MODULES:
            importlib.import_module(f"kernels.{module}")
        self.kernels = [
            (name, value)
            for module in KERNEL_MODULES
            for name, value in vars(sys.modules[f"kernels.{module}"]).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel")
        ]
        self.sink, self.model, self.dtype = sink, model, dtype

    def __enter__(self) -> recording:
        for name, kernel in self.kernels:

            def run(*args, grid, warmup, _kernel=kernel, _name=name, **kwargs):
                label = _name.strip("_").removesuffix("_kernel")
                self.sink.append(
                    RecordedLaunch(_kernel, label, self.model, self.dtype, args, kwargs)
                )

            kernel.run = run  # an instance attribute shadows JITFunction.run
        return self

    def __exit__(self, *exc) -> None:
        for _, kernel in self.kernels:
            del kernel.run


# ---------------------------------------------------------------------------------------------
# Compiling offline


def compile_report(launch: RecordedLaunch, arch: int) -> Report:
    """Compile one recorded launch the way the JIT would (same specialization: pointer and
    stride divisibility) and read registers and spills from ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    source = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        suffix = "a" if arch == 90 else ""
        result = subprocess.run(
            [get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", ptx.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spill_bytes = int(re.search(r"(\d+) bytes spill stores", result.stderr).group(1))
    num_warps = options.num_warps
    shared = compiled.metadata.shared
    programs = programs_per_sm(registers, num_warps, shared, arch)
    constants = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()}
    tile = constants.get("TILE_TOKENS")
    in_flight = None
    if tile is not None:
        element_bytes = 4 if launch.dtype == "float32" else 2
        in_flight = programs * 2 * tile * constants["HEAD_DIM"] * element_bytes
    return Report(
        kernel=launch.name,
        choice=launch.choice,
        model=launch.model,
        dtype=launch.dtype,
        tile_tokens=tile,
        num_warps=num_warps,
        registers=registers,
        spill_bytes=spill_bytes,
        shared_bytes=shared,
        programs_per_sm=programs,
        warps_per_sm=programs * num_warps,
        kv_bytes_in_flight_per_sm=in_flight,
    )


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, arch: int) -> int:
    """Resident programs per SM: the tightest of the register, shared-memory, warp and block
    limits. Registers are allocated per warp in units of 256 (8 per thread)."""
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // registers_per_warp // num_warps
    by_shared = SHARED_BYTES_PER_SM.get(arch, SHARED_BYTES_PER_SM[80]) // (
        shared_bytes + SHARED_RESERVED_PER_PROGRAM
    )
    return min(by_registers, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_PROGRAMS_PER_SM)


def print_row(r: Report) -> None:
    tile = f"tile {r.tile_tokens:>2}" if r.tile_tokens else "       "
    in_flight = (
        f"  K/V in flight/SM {r.kv_bytes_in_flight_per_sm // 1024:>3} KiB"
        if r.kv_bytes_in_flight_per_sm
        else ""
    )
    mark = "*" if r.choice == "wrapper" else " "
    print(
        f"{mark} {r.kernel:<17} {r.model:<13} {r.dtype:<8}  {tile} warps {r.num_warps}  "
        f"regs {r.registers:>3}  spill {r.spill_bytes:>4} B  smem {r.shared_bytes // 1024:>3} KiB  "
        f"{r.programs_per_sm:>2} programs = {r.warps_per_sm:>2} warps/SM{in_flight}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
