"""One layer's prefill attention on CPU: a prompt chunk over the paged cache, three ways.

    python -m benchmarks.cpu_prefill_attention                  # 512 new tokens, no prefix
    python -m benchmarks.cpu_prefill_attention --query-len 256 --context 1024   # cached prefix

One request's chunk of --query-len tokens, the last of its --context tokens (the rest a cached
prefix), in SmolLM2's shape by default (9 query heads, 3 KV heads, head_dim 64, bfloat16),
its blocks shuffled in the torch backend's head-major pool ([Hkv, blocks, 16, D]). Each timed
call runs --layers layers in turn, each over its own cache, and the time per layer is the
call's over the layer count. Timed, per layer:
- torch: the blocks gathered into contiguous K/V (index_select), then
  F.scaled_dot_product_attention(enable_gqa=True) with the causal mask offset by the prefix;
- cpu_rows: the C++ kernel (kernels/cpu_paged_attention.cpp) with its tiles off: every query
  token and head is a row multiplied key by key (AVX-512);
- cpu_kernel: the same kernel as the engine runs it: bfloat16 items of >= 8 query tokens
  multiply 16 queries x 16 keys at a time, on AMX tiles where the CPU has them
  (kernels/cpu_prefill_amx.h), in float32 FMAs on AVX-512 CPUs without AVX512-BF16
  (kernels/cpu_prefill_f32.h).
FLOP/s counts 4 x heads x head_dim per (query, visible key) pair, causal. Outputs are checked
against the float32 reference first. Prints JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import emit
from benchmarks.cpu_attention import time_ms
from kernels.cpu_attention import load_extension, paged_attention_prefill_cpu
from kernels.reference import paged_attention_prefill_ref

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--query-len", type=int, default=512, help="new tokens in the chunk")
    p.add_argument("--context", type=int, help="tokens in all, prefix included (default: query)")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layers", type=int, default=30, help="caches read in turn per call")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def causal_flops(query_len: int, context: int, num_heads: int, head_dim: int) -> int:
    """4 x heads x head_dim per (query, key it sees): QK^T and PV, a multiply-add each."""
    prefix = context - query_len
    pairs = sum(prefix + i + 1 for i in range(query_len))
    return 4 * num_heads * head_dim * pairs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ext = load_extension()
    dtype = DTYPES[args.dtype]
    q_len, ctx = args.query_len, args.context or args.query_len
    if not 0 < q_len <= ctx:
        raise SystemExit("--query-len: between 1 and --context expected")
    h, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(args.seed)
    num_blocks = -(-ctx // bs)
    pool = num_blocks * 4  # room to shuffle into
    caches = [
        tuple(torch.randn(hkv, pool, bs, d, generator=gen).to(dtype) for _ in range(2))
        for _ in range(args.layers)
    ]
    table = torch.randperm(pool, generator=gen)[:num_blocks].to(torch.int32)
    tables = table[None, :].contiguous()
    seq_lens = torch.tensor([ctx], dtype=torch.int32)
    starts = torch.tensor([0, q_len], dtype=torch.int32)
    query = torch.randn(q_len, h, d, generator=gen).to(dtype)
    out = torch.empty_like(query)
    scale = d**-0.5
    # The kernel's view of a head-major cache: [blocks, bs, Hkv, D].
    views = [(k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)) for k, v in caches]
    rows = table.long()
    # The causal mask of the chunk's queries over the whole context (True = attend).
    positions = torch.arange(ctx - q_len, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] <= positions

    def torch_path() -> None:
        for k, v in caches:
            kc = k.index_select(1, rows).reshape(hkv, -1, d)[:, :ctx]
            vc = v.index_select(1, rows).reshape(hkv, -1, d)[:, :ctx]
            F.scaled_dot_product_attention(
                query.transpose(0, 1), kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
            )

    def kernel() -> None:
        for k, v in views:
            paged_attention_prefill_cpu(query, k, v, tables, seq_lens, starts, scale, out=out)

    reference = paged_attention_prefill_ref(
        query.float(), views[0][0].float(), views[0][1].float(), tables, seq_lens, starts, scale
    )
    errors = {}
    results = {}
    tiles = ext.prefill_tiles()
    for name, use_tiles in (("cpu_rows", False), ("cpu_kernel", True)):
        ext.set_prefill_tiles(use_tiles)
        try:
            got = paged_attention_prefill_cpu(
                query, views[0][0], views[0][1], tables, seq_lens, starts, scale
            )
            errors[name] = ((got.float() - reference).norm() / reference.norm()).item()
            results[name] = time_ms(kernel, args.repeats)
        finally:
            ext.set_prefill_tiles(True)
    results["torch"] = time_ms(torch_path, args.repeats)
    flops = causal_flops(q_len, ctx, h, d)
    per_layer = {}
    for name, t in results.items():
        ms = t["min_ms"] / args.layers
        per_layer[name] = {
            "min_ms": round(ms, 3),
            "median_ms": round(t["median_ms"] / args.layers, 3),
            "gflop_per_s": round(flops / (ms * 1e-3) / 1e9, 1),
        }
    report = {
        "benchmark": "cpu_prefill_attention",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "shape": {
            "query_len": q_len,
            "context": ctx,
            "num_heads": h,
            "num_kv_heads": hkv,
            "head_dim": d,
            "block_size": bs,
            "dtype": args.dtype,
        },
        "threads": torch.get_num_threads(),
        # the kernel's tiles for >= 8-token items: "amx", "float32" or "" (the row path)
        "prefill_tiles": tiles,
        "layers_in_turn": args.layers,
        "flops_per_layer": flops,
        "per_layer": per_layer,
        "relative_error_vs_float32": {k: round(v, 5) for k, v in errors.items()},
        "cpu_kernel_speedup_vs_rows": round(
            per_layer["cpu_rows"]["min_ms"] / per_layer["cpu_kernel"]["min_ms"], 2
        ),
        "cpu_kernel_speedup_vs_torch": round(
            per_layer["torch"]["min_ms"] / per_layer["cpu_kernel"]["min_ms"], 2
        ),
    }
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
