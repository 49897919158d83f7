"""GPU tuning and before/after runs (one command, a few minutes of a lent GPU): every launch
candidate of the Triton weight-only GEMMs, then each GPU optimization against its "before" end
to end, then where a batch-1 token's time goes.

Part 1, the sweep: for each weight format (w4a16, w8a16), layer shape (SmolLM2-135M's and
Llama-3-8B's q/k/v, o, gate/up, down and SmolLM2's LM head) and decode rows (1, 64), every
candidate of kernels/weight_only_launch.launch_candidates is checked against the first launch's
output and timed the way a decode step runs it: calls on distinct weight copies (together >= 2x
the L2, or 512 copies), so each call streams its weight from memory as successive layers do,
captured in one CUDA graph (launch overhead out, as in the engine's graphs), replayed.
Baselines in the same loop: the first launches (W4A16_FIRST, W8A16_FIRST) and the 16-bit
matmul (cuBLAS) of unquantized weights. Each row: us per call and % of the weight-bytes floor.

Part 2, end to end: greedy tokens with and without the fused Triton ops (float32, CUDA graphs;
their bf16 bit-exactness is a gpu-marked test, tests/test_fused_ops_triton.py); then decode
tokens/s through the engine with CUDA graphs, batch 1 and 64, for each change against its
before (E2E_CONFIGS: torch vs fused ops, the first weight-only launches vs the engine's picks),
the engines built side by side and measured interleaved.

Part 3: where a batch-1 decode token's time goes with CUDA graphs (cProfile of the engine's
Python, the step count, and the GPU time of the graph replays from the torch profiler).

    python scripts/gpu_tune.py --json out.json [--budget-s 420]   # or: make gpu-tune
    python scripts/gpu_tune.py --skip-sweep    # parts 2 and 3 only (~2 minutes)
    python scripts/gpu_tune.py --cpu     # tiny sizes under TRITON_INTERPRET (a test)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import pstats
import sys
import time
from pathlib import Path

START_S = time.monotonic()
# (model, layer, N, K); group size 64 for int4 (SmolLM2's 576 and 1536 are not multiples of 128).
SHAPES = (
    ("smollm2", "qkv", 960, 576), ("smollm2", "o", 576, 576), ("smollm2", "gate_up", 3072, 576),
    ("smollm2", "down", 576, 1536), ("smollm2", "lm_head", 49152, 576),
    ("llama3-8b", "qkv", 6144, 4096), ("llama3-8b", "o", 4096, 4096),
    ("llama3-8b", "gate_up", 28672, 4096), ("llama3-8b", "down", 4096, 14336),
)  # fmt: skip
CPU_SHAPES = (("tiny", "gate_up", 192, 256),)
ROWS = (1, 64)  # 2..16 rows run the same 16-row tiles as 1
GROUP_SIZE = 64
L2_COPIES_FACTOR = 2  # weight copies per timing: together >= 2x the L2 ...
MAX_COPIES = 512  # ... up to this many (SmolLM2's o_proj: 512 x 0.2 MB)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny correctness run, interpreter")
    parser.add_argument("--json", type=Path, help="write the rows and the picks to this file")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start nothing after this")
    parser.add_argument("--sweep-budget-s", type=float, default=230.0, help="sweep until this")
    parser.add_argument("--skip-sweep", action="store_true", help="parts 2 and 3 only")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from gpu_check import copy_bandwidth_bytes_per_s, start  # scripts/ is on sys.path

    if (started := start(args.cpu)) is None:
        return 2
    torch, device = started
    report: dict = {"sweep": [], "picks": {}, "e2e": [], "profile": {}}
    if not args.cpu:
        report["device"] = torch.cuda.get_device_name(device)
        report["bandwidth_bytes_per_s"] = copy_bandwidth_bytes_per_s(torch)
    failed = False if args.skip_sweep else sweep(torch, device, args, report)
    save(args, report)
    if not args.cpu:
        failed |= fused_ops_parity(torch, report)
        save(args, report)
        failed |= end_to_end(torch, args, report)
        save(args, report)
        try:
            profile_batch1(torch, args, report)
        except Exception as exc:  # the numbers above are saved either way
            report["profile"]["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  profile: {type(exc).__name__}: {exc}", flush=True)
        save(args, report)
    print_summary(report)
    return 1 if failed else 0


def save(args: argparse.Namespace, report: dict) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))


def out_of_time(args: argparse.Namespace) -> bool:
    return time.monotonic() - START_S > args.budget_s


# ---------------------------------------------------------------------------------------------
# Part 1: the sweep


def sweep(torch, device, args: argparse.Namespace, report: dict) -> bool:
    from kernels.weight_only_launch import (
        W4A16_FIRST,
        W8A16_FIRST,
        launch_candidates,
        weight_only_launch,
    )

    failed = False
    l2_bytes = 0 if args.cpu else torch.cuda.get_device_properties(device).L2_cache_size
    for model, layer, n, k in CPU_SHAPES if args.cpu else SHAPES:
        for kind, first in (("w4a16", W4A16_FIRST), ("w8a16", W8A16_FIRST)):
            if time.monotonic() - START_S > args.sweep_budget_s:
                print(f"  sweep: out of time before {model} {layer} {kind}", flush=True)
                return failed
            weights = random_weights(torch, kind, n, k, device, l2_bytes)
            bf16 = None if args.cpu else bf16_weights(torch, n, k, device, l2_bytes)
            for m in (1, 5) if args.cpu else ROWS:
                x = torch.randn(
                    m, k, device=device, dtype=torch.float32 if args.cpu else torch.bfloat16
                )
                ref = call(kind, x, weights[0], first).float()
                timings: dict[str, float] = {}
                candidates = [first] + [
                    c for c in launch_candidates(kind, GROUP_SIZE) if c != first
                ]
                for launch in candidates[:3] if args.cpu else candidates:
                    row = time_launch(torch, kind, x, weights, launch, ref, args.cpu)
                    failed |= not row["ok"]
                    if row["ok"] and row["us"] is not None:
                        timings[str(launch)] = row["us"]
                    report["sweep"].append({"model": model, "layer": layer, "n": n, "k": k, **row})
                if args.cpu:
                    continue
                bf16_us = graph_us(torch, lambda w, xx=x: torch.nn.functional.linear(xx, w), bf16)
                pick = min(timings, key=timings.get)
                rule = weight_only_launch(kind, m, n, k, GROUP_SIZE)  # what the engine runs
                floor_us = 1e6 * weight_bytes(kind, n, k) / report["bandwidth_bytes_per_s"]
                key = f"{kind} {n}x{k} m{m}"
                report["picks"][key] = {
                    "model": model, "layer": layer, "pick": pick, "pick_us": timings[pick],
                    "first_us": timings[str(first)], "bf16_us": bf16_us, "floor_us": floor_us,
                    "rule": str(rule), "rule_us": timings.get(str(rule)),
                }  # fmt: skip
                print(f"  {model:<9} {layer:<7} {kind} m={m:<3} best {pick:<16} "
                      f"{timings[pick]:7.1f} us  first {timings[str(first)]:7.1f}  "
                      f"bf16 {bf16_us:7.1f}  floor {floor_us:6.1f}", flush=True)  # fmt: skip
            del weights, bf16
            torch.cuda.empty_cache() if not args.cpu else None
    return failed


def time_launch(torch, kind: str, x, weights: list, launch, ref, cpu: bool) -> dict:
    """One candidate: its error against the first launch's output, then its graph time. A
    launch the GPU cannot run (shared memory of its stages) is a row with the reason."""
    row = {"kind": kind, "m": x.shape[0], "launch": str(launch), "us": None}
    try:
        y = call(kind, x, weights[0], launch).float()
    except Exception as exc:  # triton's OutOfResources, for one
        return {**row, "ok": True, "skipped": f"{type(exc).__name__}: {exc}"[:160]}
    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    row.update(rel_err=err, ok=err <= 2e-2)
    if not cpu and row["ok"]:
        row["us"] = graph_us(torch, lambda w: call(kind, x, w, launch), weights)
    return row


def weight_bytes(kind: str, n: int, k: int) -> int:
    if kind == "w8a16":
        return n * k + 2 * n
    return n * k // 2 + (k // GROUP_SIZE) * n * 2 * 2  # nibbles + (scale, zero) in bf16


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return (
        1
        if l2_bytes == 0
        else min(MAX_COPIES, max(2, math.ceil(L2_COPIES_FACTOR * l2_bytes / nbytes)))
    )


def random_weights(torch, kind: str, n: int, k: int, device, l2_bytes: int) -> list:
    """Distinct random weights in the kernel's stored format (values, not quality, matter)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(copies_for(weight_bytes(kind, n, k), l2_bytes)):
        if kind == "w8a16":
            q = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
            out.append((q, torch.rand(n, generator=gen, device=device).to(dtype) * 1e-2))
        else:
            packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device).to(
                torch.uint8
            )
            sz = torch.rand(k // GROUP_SIZE, n, 2, generator=gen, device=device).to(dtype) * 1e-2
            out.append((packed, sz))
    return out


def bf16_weights(torch, n: int, k: int, device, l2_bytes: int) -> list:
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16)
            for _ in range(copies_for(2 * n * k, l2_bytes))]  # fmt: skip


def call(kind: str, x, weight, launch):
    from kernels.w4a16_gemm import w4a16_gemm
    from kernels.w8a16_gemm import w8a16_gemm

    if kind == "w8a16":
        return w8a16_gemm(x, weight[0], weight[1], launch=launch)
    return w4a16_gemm(x, weight[0], weight[1], GROUP_SIZE, launch=launch)


def graph_us(torch, fn, weights: list, replays: int = 8) -> float:
    """Microseconds per call of fn over the weight copies, one CUDA graph of all the calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compiles, and warms the allocator outside the capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / (replays * len(weights))


# ---------------------------------------------------------------------------------------------
# Part 2: end to end, each change against its "before" in the same process

# (label, EngineConfig overrides, weight-only launches: "engine" = weight_only_launch's picks,
# "first" = W4A16_FIRST / W8A16_FIRST)
E2E_CONFIGS = (
    ("bf16 torch ops", {"fused_ops": False}, "engine"),
    ("bf16 fused ops", {}, "engine"),
    ("int8 first launches", {"quantization": "int8"}, "first"),
    ("int8", {"quantization": "int8"}, "engine"),
    ("int4 first launches", {"quantization": "int4"}, "first"),
    ("int4", {"quantization": "int4"}, "engine"),
)
E2E_REPEATS = 3  # measurements of each engine, interleaved; the median is reported


def first_launches(kind: str, m: int, n: int, k: int, group_size: int = 0):
    from kernels.weight_only_launch import W4A16_FIRST, W8A16_FIRST

    return W4A16_FIRST if kind == "w4a16" else W8A16_FIRST


def make_engine(llm_cls, model: str, overrides: dict, launches: str):
    """An engine whose CUDA graphs captured `launches` (the launch is chosen at capture)."""
    import kernels.w4a16_gemm as w4
    import kernels.w8a16_gemm as w8

    engine_picks = w4.weight_only_launch
    if launches == "first":
        w4.weight_only_launch = w8.weight_only_launch = first_launches
    try:
        return llm_cls(model=model, dtype="bfloat16", quantization_group_size=GROUP_SIZE,
                       max_num_seqs=64, num_kv_blocks=2048, attention_backend="triton",
                       **overrides)  # fmt: skip
    finally:
        w4.weight_only_launch = w8.weight_only_launch = engine_picks


def end_to_end(torch, args: argparse.Namespace, report: dict) -> bool:
    """Decode tok/s of every E2E_CONFIGS engine, built side by side and measured interleaved
    (one process's GPU state drifts between runs: single runs moved 30%)."""
    from gpu_check import decode_tokens_per_s  # scripts/ is on sys.path (run as a script)

    from engine import LLM, SamplingParams

    failed = False
    for model in ("random:smollm2-135m", "random:llama-3-8b,num_layers=4"):
        if out_of_time(args):
            return failed
        engines = {}
        for label, overrides, launches in E2E_CONFIGS:
            try:
                engines[label] = make_engine(LLM, model, overrides, launches)
            except Exception as exc:
                failed = True
                report["e2e"].append({"model": model, "case": label, "error": f"{exc}"[:200]})
                print(f"  e2e {model} {label}: {type(exc).__name__}: {exc}", flush=True)
        for batch in (1, 64):
            rates: dict[str, list[float]] = {label: [] for label in engines}
            for _ in range(E2E_REPEATS):
                for label, llm in engines.items():
                    rates[label].append(decode_tokens_per_s(llm, SamplingParams, batch))
            for label, values in rates.items():
                median = sorted(values)[len(values) // 2]
                report["e2e"].append({"model": model, "case": label, "batch": batch,
                                      "tok_per_s": median, "runs": values})  # fmt: skip
                print(f"  e2e {model.removeprefix('random:')} {label} b{batch}: {median:,.0f} "
                      f"decode tok/s (runs {', '.join(f'{v:,.0f}' for v in values)})", flush=True)  # fmt: skip
        del engines
        gc.collect()
        torch.cuda.empty_cache()
    return failed


def fused_ops_parity(torch, report: dict) -> bool:
    """Greedy tokens with the Triton ops and with torch's, float32, CUDA graphs."""
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (8 + 13 * i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for fused in (False, True):
        llm = LLM(model="random:smollm2-135m", dtype="float32", fused_ops=fused, max_num_seqs=8,
                  max_model_len=512, attention_backend="triton")  # fmt: skip
        tokens[fused] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    same = tokens[True] == tokens[False]
    report["fused_ops_parity"] = "identical greedy tokens, 6 x 24" if same else "tokens DIFFER"
    print(f"  fused ops parity (float32, graphs): {report['fused_ops_parity']}", flush=True)
    return not same


# ---------------------------------------------------------------------------------------------
# Part 3: a batch-1 token with CUDA graphs


def profile_batch1(torch, args: argparse.Namespace, report: dict) -> None:
    if out_of_time(args):
        return
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM(model="random:smollm2-135m", dtype="bfloat16", max_num_seqs=8,
              attention_backend="triton")  # fmt: skip
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    prompt = [list(range(1, 129))]
    llm.generate(prompt, params)  # warm-up
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompt, params)
    profiler.disable()
    wall_s = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    report["profile"]["wall_ms_per_token"] = 1e3 * wall_s / 64
    report["profile"]["cprofile_tottime"] = text.getvalue()[-12000:]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    report["profile"]["torch_profiler_cuda"] = table[-12000:]
    print(f"  batch-1 smollm2 graphs: {1e3 * wall_s / 64:.2f} ms/token (wall, 64 tokens)")
    print(table[:6000], flush=True)


def print_summary(report: dict) -> None:
    if not report["picks"]:
        print(f"{len(report['sweep'])} sweep rows, all ok: {all(r['ok'] for r in report['sweep'])}")
        return
    print("\nkind   shape          m   pick              us    first us  bf16 us  floor us  %floor")
    for key, p in report["picks"].items():
        kind, shape, m = key.split()
        print(f"{kind}  {shape:<13} {m:<4} {p['pick']:<16} {p['pick_us']:6.1f}  {p['first_us']:8.1f}"
              f"  {p['bf16_us']:7.1f}  {p['floor_us']:8.1f}  {100 * p['floor_us'] / p['pick_us']:5.0f}%")  # fmt: skip
    print(f"{time.monotonic() - START_S:.0f} s total")


if __name__ == "__main__":
    sys.exit(main())
