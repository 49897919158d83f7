"""A guard against AutoAWQ's silent weight corruption on CPU.

AwqQuantizer._compute_best_scale saves the block's original weights with
`{k: v.cpu() for k, v in module.state_dict().items()}` before it tries each scale ratio, then
scales the weights in place (`fc.weight.mul_(scales)`) and restores the "saved" copy. On a GPU
`.cpu()` copies; on CPU it returns the very same tensor, so the in-place scaling also rewrites
the saved copy, every restore brings back scaled weights, and the 20 ratios compound: the
model comes out ruined (held-out NLL 14.6 instead of 3.4 on SmolLM2-135M) without any error.

CpuSafeAwqQuantizer makes `Tensor.cpu` return a copy for the duration of that one method, in
the calling thread only, so the saved originals stay intact. Nothing in site-packages is edited.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_original_cpu = torch.Tensor.cpu
_local = threading.local()  # depth of cpu_returns_copies() in this thread
_patch_lock = threading.Lock()
_patch_users = 0  # threads inside cpu_returns_copies(): the patch is installed while > 0


def _cpu_copying(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = _original_cpu(self, *args, **kwargs)
    # Only in a guarded thread, and only where .cpu() aliased (the tensor was already on CPU).
    if getattr(_local, "depth", 0) and out is self:
        return out.clone()
    return out


@contextmanager
def cpu_returns_copies() -> Iterator[None]:
    """Inside: `t.cpu()` of a CPU tensor returns a copy in this thread (others unchanged)."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            torch.Tensor.cpu = _cpu_copying
        _patch_users += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                torch.Tensor.cpu = _original_cpu


def cpu_safe_quantizer_cls() -> type:
    """AutoAWQ's AwqQuantizer with the guard around _compute_best_scale (import deferred:
    autoawq is only needed when a checkpoint is produced)."""
    from awq.quantize.quantizer import AwqQuantizer

    class CpuSafeAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with cpu_returns_copies():
                return super()._compute_best_scale(*args, **kwargs)

    return CpuSafeAwqQuantizer
