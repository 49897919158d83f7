"""One layer's decode attention on CPU: the torch backend's paths vs the in-place C++ kernel.

    python -m benchmarks.cpu_attention                      # batch 64 x ~400 tokens, bf16
    python -m benchmarks.cpu_attention --batch 1 --context 2048 --json results/cpu_attn.json

The paged cache is the torch backend's head-major one ([Hkv, blocks, 16, D], shuffled blocks),
with SmolLM2's shape by default (9 query heads, 3 KV heads, head_dim 64). As in a decode step,
each timed call runs --layers layers in turn, each over its own cache allocated the way the
engine allocates its pool (transparent huge pages, engine/runner/host_memory.py), and
the per-layer time is the call's over the layer count: one layer's 20 MB timed again and again
would sit in a 32 MB L3 that a real step, reading 30 layers' caches, never has. Timed, per layer,
store excluded (every path stores the same way):
- gather: the torch backend copying each request's blocks into its workspace (index_select);
- gather_bmm: the torch backend's decode path (gather, then two batched matmuls);
- gather_sdpa: the same gather, then F.scaled_dot_product_attention(enable_gqa=True);
- cpu_kernel: kernels.cpu_attention reading the blocks in place (what attention_backend="cpu"
  runs);
- read_only: the same K/V rows read in the kernel's order, with its prefetch and threads, and
  only summed (the extension's read_kv_rows): how fast this pattern of scattered blocks can be
  read at all on this machine, the share of the kernel's time that no arithmetic can remove;
- cpu_kernel_in_cache: the kernel with every request's table pointing into the same 16 blocks
  (they stay in cache): its arithmetic with no memory traffic. The kernel's time against
  read_only + this tells how much of the two overlap.
Where the blocks sit (cpu_kernel and read_only are timed on both, in one run):
- shuffled: every request's blocks anywhere in the pool (a long-running server's worst case:
  every block a jump the hardware prefetcher does not follow);
- engine: the tables the engine's own BlockManager hands out when the batch arrives at once,
  the scheduler's way: prompts (context - --decoded tokens) prefilled in 512-token chunks in
  arrival order, requests whose prompt is done decoding one token per step meanwhile, until
  every request holds its context. Prompt blocks come out in runs of consecutive ids, decode
  blocks interleaved across requests;
- contiguous: every request's blocks consecutive, one request after another (what no allocator
  of a running server keeps, and the best any could): the most a placement policy could gain.
The floor is the K/V bytes the step must read over the bandwidth measured here (a large
tensor copy, read + write bytes, as engine/telemetry/ceilings.py measures it). Each path is
timed `--repeats` times after a warm-up; min and median are reported (a shared machine's
noise lands in the median; on a loaded machine 2-thread runs suffer most, as every parallel
op waits for its slowest thread: --threads 1 is the steadier comparison). All outputs are
checked against each other first.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import emit
from engine.core.block_manager import BlockManager, cdiv
from engine.runner.attention.base import AttentionInputs
from engine.runner.attention.kv_quant import LayerKVCache
from engine.runner.attention.torch_backend import TorchBackend, _gather, decode_attention
from engine.runner.host_memory import zeros_in_huge_pages
from engine.telemetry.ceilings import measure_bandwidth
from kernels.cpu_attention import load_extension, paged_attention_decode_cpu

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="decode requests")
    p.add_argument("--context", type=int, default=400, help="mean context length, tokens")
    p.add_argument("--spread", type=int, default=48, help="contexts uniform in mean +- spread")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument(
        "--decoded", type=int, default=128,
        help="engine placement: tokens each request has decoded (the rest was its prompt)",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=30, help="caches read in turn per call")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p.parse_args()


def time_ms(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Wall time, and this process's CPU time (all threads, spin-waits included): on a shared
    machine a 1-thread run's CPU time leaves out the time other processes held the core."""
    fn()  # warm-up (workspace growth, oneDNN primitive creation)
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return {
        "min_ms": min(wall), "median_ms": statistics.median(wall),
        "cpu_min_ms": min(cpu), "cpu_median_ms": statistics.median(cpu),
    }  # fmt: skip


def tables_from_ids(ids: list[int], seq_lens: list[int], bs: int) -> list[list[int]]:
    """The block ids handed out in order: each request takes the next ones it needs."""
    tables, used = [], 0
    for n in seq_lens:
        tables.append(ids[used : used + cdiv(n, bs)])
        used += cdiv(n, bs)
    return tables


def shuffled_tables(seq_lens: list[int], bs: int, rng: random.Random) -> list[list[int]]:
    ids = list(range(sum(cdiv(n, bs) for n in seq_lens)))
    rng.shuffle(ids)
    return tables_from_ids(ids, seq_lens, bs)


def engine_tables(
    seq_lens: list[int], bs: int, decoded: int, token_budget: int = 512
) -> list[list[int]]:
    """The block tables the engine's BlockManager gives these requests arriving together:
    per step, every request past its prompt decodes one token (until it holds its context),
    and what is left of the token budget prefills the waiting prompts in order."""
    manager = BlockManager(sum(cdiv(n, bs) for n in seq_lens), bs)
    prompts = [max(1, n - decoded) for n in seq_lens]
    held = [0] * len(seq_lens)  # tokens whose K/V each request holds
    while held != seq_lens:
        budget = token_budget
        for i, n in enumerate(seq_lens):
            if prompts[i] <= held[i] < n:
                held[i] += 1
                budget -= 1
                manager.allocate(str(i), held[i])
        for i in range(len(seq_lens)):
            if budget and held[i] < prompts[i]:
                chunk = min(budget, prompts[i] - held[i])
                held[i] += chunk
                budget -= chunk
                manager.allocate(str(i), held[i])
    return [manager.block_table(str(i)) for i in range(len(seq_lens))]


def contiguous(seq_lens: list[int], bs: int) -> list[list[int]]:
    """Each request's blocks consecutive, the requests one after another."""
    return tables_from_ids(list(range(sum(cdiv(n, bs) for n in seq_lens))), seq_lens, bs)


def runs_of_consecutive_blocks(tables: list[list[int]]) -> dict[str, float]:
    """How contiguous the tables are: runs of consecutive block ids (ascending or descending:
    a freed request's blocks rejoin the free list tail first)."""
    runs = [
        1 + sum(abs(b - a) != 1 for a, b in itertools.pairwise(table)) for table in tables if table
    ]
    blocks = sum(len(t) for t in tables)
    return {"runs": sum(runs), "blocks": blocks, "mean_blocks_per_run": blocks / sum(runs)}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernel's OpenMP team follows it too
    rng = random.Random(args.seed)
    dtype, bs, hkv, dim = DTYPES[args.dtype], args.block_size, args.num_kv_heads, args.head_dim
    lo, hi = max(1, args.context - args.spread), args.context + args.spread
    seq_lens = sorted(rng.randint(lo, hi) for _ in range(args.batch))  # the runner sorts too
    num_blocks = sum(cdiv(n, bs) for n in seq_lens) + 8
    tables = shuffled_tables(seq_lens, bs, rng)
    placed_tables = engine_tables(seq_lens, bs, args.decoded)
    contiguous_tables = contiguous(seq_lens, bs)

    backend = TorchBackend(hkv, dim, bs, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    shape = backend.kv_cache_shape(num_blocks)  # [Hkv, blocks, bs, D]
    caches = []
    for _ in range(args.layers):
        layer = [zeros_in_huge_pages(shape, dtype, torch.device("cpu")) for _ in range(2)]
        for c in layer:
            c.copy_(torch.randn(shape, generator=gen))
        caches.append(layer)
    k_cache, v_cache = caches[0]  # the one the outputs are compared on
    query = torch.randn(args.batch, args.num_heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    inputs = AttentionInputs(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_seq_lens=seq_lens,
        decode_block_tables=tables, prefill_q_lens=[], prefill_ctx_lens=[],
        prefill_block_tables=[],
    )  # fmt: skip
    meta = backend.build_metadata(inputs, [LayerKVCache(k_cache, v_cache)])

    def gather(layer):
        for g in meta.decode_groups:
            _gather(LayerKVCache(*layer), g.gather_index, meta.workspace)

    def gather_then(attend, layer):
        out = torch.empty_like(query)
        for g in meta.decode_groups:
            k, v = _gather(LayerKVCache(*layer), g.gather_index, meta.workspace)
            n = g.end - g.start
            k, v = k.view(hkv, n, -1, dim), v.view(hkv, n, -1, dim)
            out[g.start : g.end] = attend(query[g.start : g.end], k, v, g.ctx_mask)
        return out

    def sdpa(q, k, v, mask):
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )  # fmt: skip
        return o.squeeze(2)

    load_extension()  # built (or loaded from the cache) before any timing
    kernel_lens = torch.tensor(seq_lens, dtype=torch.int32)
    kernel_out = torch.empty_like(query)
    starts = torch.arange(args.batch + 1, dtype=torch.int32)

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = cdiv(hi, bs)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def kernel_views(layer: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, blocks, bs, D] as the kernel's [blocks, bs, Hkv, D] view."""
        k, v = (c.permute(1, 2, 0, 3) for c in layer)
        return k, v

    def read_only_on(tables: list[list[int]]) -> Callable[[list[torch.Tensor]], int]:
        table_tensor = padded(tables)
        return lambda layer: load_extension().read_kv_rows(
            *kernel_views(layer), table_tensor, kernel_lens
        )

    def kernel_on(tables: list[list[int]]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        table_tensor = padded(tables)

        def kernel(layer):
            k_view, v_view = kernel_views(layer)
            return paged_attention_decode_cpu(
                query, k_view, v_view, table_tensor, kernel_lens, scale, out=kernel_out,
                query_start_loc=starts,
            )  # fmt: skip

        return kernel

    paths = {
        "gather_bmm": lambda layer: gather_then(
            lambda q, k, v, m: decode_attention(q, k, v, m, scale), layer
        ),
        "gather_sdpa": lambda layer: gather_then(sdpa, layer),
        "cpu_kernel": kernel_on(tables),
    }
    outs = {name: fn(caches[0]).float() for name, fn in paths.items()}
    ref = outs["gather_sdpa"]
    agreement = {n: ((o - ref).norm() / ref.norm()).item() for n, o in outs.items()}

    def per_layer(fn) -> dict[str, float]:
        """One call = every layer in turn (as a step); its times over the layer count."""
        times = time_ms(lambda: [fn(layer) for layer in caches], args.repeats)
        return {k: v / len(caches) for k, v in times.items()}

    results = {"gather": per_layer(gather)}
    results |= {name: per_layer(fn) for name, fn in paths.items()}
    results["read_only"] = per_layer(read_only_on(tables))
    in_cache = [[i % min(16, num_blocks) for i in range(len(t))] for t in tables]
    results["cpu_kernel_in_cache"] = per_layer(kernel_on(in_cache))
    # The same K/V rows moved to where each placement's tables put them, then timed there.
    current = tables
    for name, placement in (("engine_placement", placed_tables), ("contiguous", contiguous_tables)):
        for layer in caches:
            for c in layer:
                moved = torch.empty_like(c)
                for old_table, new_table in zip(current, placement, strict=True):
                    moved[:, new_table] = c[:, old_table]
                c.copy_(moved)
        current = placement
        results[f"cpu_kernel_{name}"] = per_layer(kernel_on(placement))
        results[f"read_only_{name}"] = per_layer(read_only_on(placement))
        moved_out = kernel_on(placement)(caches[0]).float()
        assert torch.equal(moved_out, outs["cpu_kernel"]), f"{name}: moving blocks changed output"
    bandwidth = measure_bandwidth("cpu")
    kv_bytes = 2 * sum(seq_lens) * hkv * dim * k_cache.element_size()
    floor_ms = kv_bytes / bandwidth * 1e3
    emit(
        {
            "benchmark": "cpu_attention",
            "shape": {
                "batch": args.batch,
                "context_tokens_mean": statistics.mean(seq_lens),
                "context_tokens_min": seq_lens[0],
                "context_tokens_max": seq_lens[-1],
                "num_heads": args.num_heads,
                "num_kv_heads": hkv,
                "head_dim": dim,
                "block_size": bs,
                "dtype": args.dtype,
            },
            "threads": torch.get_num_threads(),
            "layers_in_turn": args.layers,
            "decode_groups": len(meta.decode_groups),
            "per_layer": results,
            "kv_bytes": kv_bytes,
            "bandwidth_bytes_per_s": bandwidth,
            "floor_ms": floor_ms,
            "cpu_kernel_over_floor": results["cpu_kernel"]["median_ms"] / floor_ms,
            "cpu_kernel_engine_placement_over_floor": results["cpu_kernel_engine_placement"][
                "median_ms"
            ]
            / floor_ms,
            "cpu_kernel_contiguous_over_floor": results["cpu_kernel_contiguous"]["median_ms"]
            / floor_ms,
            "engine_placement_runs": runs_of_consecutive_blocks(placed_tables),
            "read_only_over_floor": results["read_only"]["median_ms"] / floor_ms,
            "cpu_kernel_over_read_only": results["cpu_kernel"]["median_ms"]
            / results["read_only"]["median_ms"],
            "cpu_kernel_over_read_only_plus_in_cache": results["cpu_kernel"]["median_ms"]
            / (results["read_only"]["median_ms"] + results["cpu_kernel_in_cache"]["median_ms"]),
            "speedup_vs_gather_bmm": results["gather_bmm"]["median_ms"]
            / results["cpu_kernel"]["median_ms"],
            "relative_error_vs_gather_sdpa": agreement,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
