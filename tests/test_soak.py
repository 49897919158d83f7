"""The soak script end to end, tiny: mixed requests, aborts and HTTP hang-ups leave no block
held and every request accounted for."""

from __future__ import annotations

import json

from benchmarks import soak


def test_soak_tiny_run_accounts_for_every_request_and_frees_every_block(tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = [
        "--model", "random:tiny", "--dtype", "float32", "--max-model-len", "256",
        "--num-kv-blocks", "64", "--num-requests", "60", "--concurrency", "16",
        "--max-tokens", "6", "--abort-fraction", "0.3", "--http-fraction", "0.3",
        "--rss-every", "20", "--json", str(out),
    ]  # fmt: skip
    assert soak.main(argv) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["sent"] == 60
    counted = report["ok"] + report["failed"] + report["aborted"] + report["disconnected"]
    assert counted == 60
    assert report["failed"] == 0
    assert report["aborted"] + report["disconnected"] > 0  # the mix really aborts some
    assert report["blocks_held_at_end"] == 0 and report["idle_at_end"]
    assert sorted(int(k) for k in report["rss_mb_by_requests"]) == [20, 40, 60]
    assert sorted(int(k) for k in report["malloc_mb_by_requests"]) == [20, 40, 60]  # glibc
    # The bound on native growth is in effect (set by EngineService unless the env had it).
    assert all(report["onednn_cache_capacity"].values())
    assert report["latency_p50_s"] <= report["latency_p99_s"]
