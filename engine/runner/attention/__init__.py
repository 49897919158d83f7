"""Attention over the paged KV cache: one backend interface (base.py) and a registry of
backends by name. A new backend subclasses AttentionBackend and registers itself here (or via
register_backend); the model runner only ever calls get_backend(name)."""

from __future__ import annotations

from engine.runner.attention.base import AttentionBackend
from engine.runner.attention.cpu_backend import CpuBackend
from engine.runner.attention.torch_backend import TorchBackend
from engine.runner.attention.triton_backend import TritonBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchBackend.name: TorchBackend,
    TritonBackend.name: TritonBackend,
    CpuBackend.name: CpuBackend,
}


def register_backend(name: str, backend: type[AttentionBackend]) -> None:
    """Make `backend` what attention_backend=name selects (replacing any earlier one)."""
    BACKENDS[name] = backend


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; registered: {sorted(BACKENDS)}")
    return BACKENDS[name]


def default_backend_name(device_type: str) -> str:
    """What attention_backend="auto" means: the Triton kernels on CUDA; on CPU the C++ paged
    kernel (which runs the torch path, and says so, where it cannot be built)."""
    return "triton" if device_type == "cuda" else "cpu"
