"""The small per-layer ops of the decoder (RMSNorm with its residual add, RoPE, SiLU-and-mul),
behind one interface with two implementations:

- TorchOps: plain torch, Hugging Face's arithmetic step for step (the reference).
- CpuFusedOps: the C++ kernels of kernels/cpu_fused_ops.py, one call where torch takes 3-12
  ops. On CPU a small op costs ~5 us of Python and dispatch whatever its size, and a batch-1
  decode step of SmolLM2 ran ~1,800 of them (EngineConfig.fused_ops; off = TorchOps).
- TritonFusedOps: the same ops as Triton kernels (kernels/fused_ops_triton.py) on GPUs, where
  CUDA graphs remove the launches but each small kernel still costs ~1.3 us of GPU time.

The residual stream is carried beside the hidden states (`add_rms_norm` adds the sublayer's
output into it and normalizes the sum): the same additions in the same order as
`hidden = hidden + sublayer(norm(hidden))`, so TorchOps computes exactly what it did before.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine.runner.models.arch import ModelArch


class TorchOps:
    name = "torch"
    # The C++ ops module (kernels/cpu_fused_ops.py) that linears may share for their few-row
    # products; None: they keep oneDNN / aten (the whole torch "before").
    kernels: ModuleType | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalize in float32, scale in the model dtype: what Hugging Face does (parity).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope_tables(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What rope() needs for this forward pass's tokens: cos/sin [T, 1, D/2] in dtype."""
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def rope(self, qkv: torch.Tensor, tables, num_heads: int, head_dim: int) -> torch.Tensor:
        """Rotate the first num_heads heads (q's and k's) of qkv [T, C]: [T, num_heads, D]."""
        x = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        cos, sin = tables
        half = head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, 2I]: gate then up
        return F.silu(gate) * up

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling's argmax of each row of [N, V] logits in the head's dtype: the
        first index of the max, NaN counting as the max (torch.argmax's rule). Through
        max(dim): on CPU torch's argmax of float32 [64, 49152] took 2.7 ms against max's 0.9
        (2-core Xeon)."""
        return logits.max(dim=-1).indices

    # Sampled rows' tokens in one fused op (sampler.SampleRows), or None: the sampler's torch
    # path (logits_to_probs + draw_tokens).
    sample_rows = None


class FusedOps(TorchOps):
    """One kernel call per op through `impl`, a module with the signatures of
    kernels/cpu_fused_ops.py (rms_norm, add_rms_norm, rope_, silu_mul); inputs are the
    model's own contiguous activations."""

    impl: ModuleType

    def rms_norm(self, x, weight, eps):
        return self.impl.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        # In place on `residual`: the model owns it (a fresh embedding output, then sums).
        return self.impl.add_rms_norm(x, residual, weight, eps), residual

    def rope_tables(self, positions, cos, sin, dtype):
        return positions, cos, sin  # the kernel reads the float32 tables by position

    def rope(self, qkv, tables, num_heads, head_dim):
        self.impl.rope_(qkv, *tables, num_heads, head_dim)  # in place
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)

    def silu_mul(self, gate_up):
        return self.impl.silu_mul(gate_up)


class CpuFusedOps(FusedOps):
    """The C++ ops (kernels/cpu_fused_ops.py), for a model whose widths they take
    (make_layer_ops checks)."""

    name = "cpu"

    def __init__(self) -> None:
        from kernels import cpu_fused_ops

        # Built (or loaded) here: CpuKernelUnavailable if not. The ops call the compiled
        # module's entry points directly (they check their inputs and allocate their outputs):
        # a Python wrapper per call was ~1 us of ~4 at batch 1.
        self.impl = cpu_fused_ops.load_extension()
        self.kernels = cpu_fused_ops  # the checked wrappers; quantized linears share them

    def argmax_rows(self, logits):
        # On the 16-bit logits as the head wrote them, no float32 copy: 64 x 49152 bfloat16
        # in 0.18 ms against 1.1 ms for widening + max(dim) (2-core Xeon).
        if logits.device.type != "cpu" or logits.dim() != 2:
            return super().argmax_rows(logits)
        return self.impl.rows_argmax(logits)

    def sample_rows(self, logits, temperature, top_k, top_p, min_p, uniforms):
        # kernels/cpu_sample_rows.h: at temperature 0.7 with top-p 0.95 (the chat tab's
        # defaults) one row of 49,152 bfloat16 logits took 0.07-0.10 ms against 0.41-0.46 ms
        # on the torch path; 64 rows with top-p 0.9 2.9 ms against 9.7 (2-core EPYC).
        return self.impl.rows_sample(logits, temperature, top_k, top_p, min_p, uniforms)


class TritonFusedOps(FusedOps):
    """The Triton ops (kernels/fused_ops_triton.py): GPUs, where CUDA graphs take the launch
    costs of torch's small ops away but not their kernels (~30 a layer, ~1.3 us each on an
    H200 at batch 1). Runs on CPU too, under TRITON_INTERPRET (the tests)."""

    name = "triton"

    def __init__(self) -> None:
        from kernels import fused_ops_triton

        self.impl = fused_ops_triton


def make_layer_ops(
    fused: bool, device: torch.device, arch: ModelArch
) -> tuple[TorchOps, str | None]:
    """The ops for a model of `arch` on `device`, and why the fused ones are not used when
    they were asked for and cannot be (None otherwise)."""
    if not fused or device.type not in ("cpu", "cuda"):
        return TorchOps(), None
    if device.type == "cuda":
        from kernels.fused_ops_triton import rope_supports

        if not rope_supports(arch.head_dim):
            return (
                TorchOps(),
                f"head_dim {arch.head_dim}: the Triton RoPE needs head_dim / 2 a power of two",
            )
        return TritonFusedOps(), None
    from kernels.cpu_build import CpuKernelUnavailable
    from kernels.cpu_fused_ops import VECTOR

    if arch.hidden_size % VECTOR or arch.intermediate_size % VECTOR or arch.head_dim % 2:
        return TorchOps(), (
            f"hidden size {arch.hidden_size} and intermediate size {arch.intermediate_size} "
            f"must be multiples of {VECTOR} and head_dim {arch.head_dim} even"
        )
    try:
        return CpuFusedOps(), None
    except CpuKernelUnavailable as exc:
        return TorchOps(), str(exc)
