"""benchmarks.cpu_attention's block placements: the engine's tables are the BlockManager's own
(valid, disjoint, covering each context), and a tiny run reports every placement."""

from __future__ import annotations

import json
import random
import sys

import pytest

from benchmarks import aims, cpu_attention
from engine.core.block_manager import cdiv
from kernels.cpu_attention import cpu_kernel_status


@pytest.mark.parametrize("placement", ["engine", "shuffled", "contiguous"])
def test_tables_cover_each_context_with_distinct_blocks(placement):
    seq_lens, bs = [40, 300, 17, 129], 16
    if placement == "engine":
        tables = cpu_attention.engine_tables(seq_lens, bs, decoded=20, token_budget=64)
    elif placement == "shuffled":
        tables = cpu_attention.shuffled_tables(seq_lens, bs, random.Random(0))
    else:
        tables = cpu_attention.contiguous(seq_lens, bs)
        assert cpu_attention.runs_of_consecutive_blocks(tables)["runs"] == len(seq_lens)
    assert [len(t) for t in tables] == [cdiv(n, bs) for n in seq_lens]
    blocks = [b for t in tables for b in t]
    assert len(set(blocks)) == len(blocks)
    assert max(blocks) < sum(cdiv(n, bs) for n in seq_lens)


def test_engine_placement_keeps_prompts_in_runs():
    """A prompt prefilled in one chunk gets consecutive blocks; decode blocks interleave."""
    tables = cpu_attention.engine_tables([160, 160], 16, decoded=32, token_budget=512)
    assert tables[0][:8] == list(range(8)) and tables[1][:8] == list(range(8, 16))
    runs = cpu_attention.runs_of_consecutive_blocks(tables)
    assert runs["blocks"] == 20 and 2 <= runs["runs"] < 20


def test_tiny_run_reports_every_placement(tmp_path, capsys, monkeypatch):
    if (why := cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")
    out = tmp_path / "attn.json"
    argv = ["cpu_attention", "--batch", "4", "--context", "40", "--spread", "8", "--layers",
            "2", "--repeats", "1", "--decoded", "8", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    cpu_attention.main()
    report = json.loads(out.read_text())
    assert set(report["per_layer"]) >= {
        "cpu_kernel", "cpu_kernel_engine_placement", "read_only", "read_only_engine_placement",
        "cpu_kernel_in_cache", "cpu_kernel_contiguous", "read_only_contiguous",
    }  # fmt: skip
    assert report["cpu_kernel_over_read_only_plus_in_cache"] > 0
    assert report["cpu_kernel_over_read_only"] > 0
    assert report["cpu_kernel_engine_placement_over_floor"] > 0
    assert report["cpu_kernel_contiguous_over_floor"] > 0
    assert report["relative_error_vs_gather_sdpa"]["cpu_kernel"] < 2e-2
    (judged,) = aims.judge(aims.AIMS, {"attention": report})
    assert judged["value"] == round(report["cpu_kernel_over_floor"], 3)


def test_prefill_benchmark_times_three_paths_and_checks_them(tmp_path):
    """benchmarks.cpu_prefill_attention on a small chunk over a cached prefix: the torch path,
    the kernel's row path and the kernel as the engine runs it, each checked against float32."""
    if (why := cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")
    from benchmarks import cpu_prefill_attention
    from kernels.cpu_attention import load_extension

    out = tmp_path / "prefill.json"
    report = cpu_prefill_attention.main(["--query-len", "40", "--context", "100", "--layers",
                                         "2", "--repeats", "1", "--json", str(out)])  # fmt: skip
    assert report == json.loads(out.read_text())
    assert set(report["per_layer"]) == {"torch", "cpu_rows", "cpu_kernel"}
    assert all(t["min_ms"] > 0 for t in report["per_layer"].values())
    assert all(e < 5e-3 for e in report["relative_error_vs_float32"].values())
    # 40 queries over a 60-token prefix: 4 x 9 heads x 64 dims x (61 + ... + 100) pairs.
    assert report["flops_per_layer"] == 4 * 9 * 64 * sum(range(61, 101))
    assert report["prefill_tiles"] == load_extension().prefill_tiles()
