"""Launch choices of the Triton weight-only GEMMs (kernels/w4a16_gemm.py, w8a16_gemm.py).

At the few rows of a decode step these kernels are memory-bound: each program streams its
weight tile through K, and a GPU reaches its bandwidth only with enough bytes in flight per
SM. A [BLOCK_N, BLOCK_K] weight tile per pipeline stage is what one program keeps in flight,
so the tile, the warps and the stages decide how close a layer gets to its weight-bytes floor.
`scripts/gpu_tune.py` times every candidate on a GPU (CUDA graphs, weights rotated
past the L2) and the picks below come from it; no table here is a guess from a datasheet.
"""

from __future__ import annotations

import dataclasses
import itertools

BLOCK_M = 16  # x rows per program: tl.dot's smallest M on tensor cores; decode rows pad to it


@dataclasses.dataclass(frozen=True)
class WeightOnlyLaunch:
    block_n: int  # output rows per program (w4a16: a multiple of 64, whole packed blocks)
    block_k: int  # inputs per K step (w4a16: divides the quantization group)
    num_warps: int
    num_stages: int  # software-pipeline depth of the K loop's loads

    def __str__(self) -> str:
        return f"n{self.block_n}/k{self.block_k}/w{self.num_warps}/s{self.num_stages}"


# The launches used before any GPU measured them; the tuning script's baseline.
W4A16_FIRST = WeightOnlyLaunch(block_n=64, block_k=32, num_warps=4, num_stages=3)
W8A16_FIRST = WeightOnlyLaunch(block_n=64, block_k=64, num_warps=4, num_stages=3)

# Picks from scripts/gpu_tune.py on one H200 (2026-12-04, triton 3.6): over the nine
# layer shapes of SmolLM2-135M and Llama-3-8B, the one launch per (format, size class, rows)
# with the least mean time relative to each shape's best (1.00 = the best launch everywhere).
# Per-shape picks gained only 3-10% more, so a rule that also covers unseen shapes is kept.
LARGE_WEIGHT_ELEMENTS = 8 << 20  # N * K from which a weight is "large" (Llama-3-8B's layers)
FEW_ROWS = 16  # rows up to this share one BLOCK_M tile: the 1-row measurement applies
PICKS = {
    # (kind, large, few rows): launch                 mean vs best (the first launch's)
    ("w4a16", False, True): WeightOnlyLaunch(64, 32, 8, 4),  # 1.00 (1.06)
    ("w4a16", False, False): WeightOnlyLaunch(64, 64, 4, 3),  # 1.08 (1.21)
    ("w4a16", True, True): WeightOnlyLaunch(128, 64, 4, 3),  # 1.03 (1.62)
    ("w4a16", True, False): WeightOnlyLaunch(128, 64, 4, 3),  # 1.08 (1.66)
    ("w8a16", False, True): WeightOnlyLaunch(64, 256, 8, 3),  # 1.04 (1.55)
    ("w8a16", False, False): WeightOnlyLaunch(64, 256, 8, 3),  # 1.07 (1.55)
    ("w8a16", True, True): WeightOnlyLaunch(128, 128, 4, 3),  # 1.05 (1.37)
    ("w8a16", True, False): WeightOnlyLaunch(64, 128, 4, 4),  # 1.10 (1.36)
}


def weight_only_launch(kind: str, m: int, n: int, k: int, group_size: int = 0) -> WeightOnlyLaunch:
    """The launch for x [m, k] @ W [n, k] (kind "w4a16" or "w8a16"; w4a16's K tile never
    straddles a group, so a group of 32 keeps 32-input tiles)."""
    if kind not in ("w4a16", "w8a16"):
        raise ValueError(f"unknown weight-only kernel {kind!r}")
    launch = PICKS[(kind, n * k >= LARGE_WEIGHT_ELEMENTS, m <= FEW_ROWS)]
    if kind == "w4a16" and group_size % launch.block_k:
        launch = dataclasses.replace(launch, block_k=32)
    return launch


def launch_candidates(kind: str, group_size: int = 0) -> list[WeightOnlyLaunch]:
    """Every launch the tuning script times for kind (w4a16: K tiles that divide the group)."""
    if kind == "w8a16":
        block_ks = [64, 128, 256]  # int8 rows are K-contiguous: 64+ bytes a row per load
    else:
        block_ks = [b for b in (32, 64, 128) if group_size % b == 0]
    return [
        WeightOnlyLaunch(block_n, block_k, warps, stages)
        for block_n, block_k, warps, stages in itertools.product(
            (64, 128, 256), block_ks, (4, 8), (3, 4)
        )
    ]
