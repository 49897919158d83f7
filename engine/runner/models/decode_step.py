"""A whole decoder pass of few rows in one C++ call on CPU (kernels/cpu_decode_step.h).

With the few-row kernels bound (llama.LayerCalls), a batch-1 token of SmolLM2 still made ~10
calls from Python per layer, ~300 a token, each paying microseconds of interpreter and argument
conversion on top of its kernel: ~1 ms of a ~4.7 ms int4 token on a 2-core EPYC, a fifth of it.
This runs the same kernels in the same order from one C++ loop over the layers (the CPU's
counterpart of a CUDA graph: the step's work, minus the host overhead between its kernels), so
its hidden states are bit-identical to the layer-by-layer path. It serves the steps that path's
few-row calls serve (decode, verify and small prefill chunks up to `max_rows` tokens) when
every piece has a C++ kernel: the fused C++ ops, each linear's few-row kernel, and the CPU
attention backend with a 16-bit cache. Anything else keeps the Python layers, and
`enforce_eager=True` turns it off with the other direct calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.runner.attention.cpu_backend import CpuAttentionMetadata, CpuBackend

if TYPE_CHECKING:
    from engine.runner.models.llama import LlamaForCausalLM


class CpuDecodeStep:
    """The compiled step (`DecodeStep` of the fused ops module) and the most tokens it takes."""

    def __init__(self, step: object, max_rows: int) -> None:
        self.step = step
        self.max_rows = max_rows

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> CpuDecodeStep | None:
        """The model's step once its weights are final and its few-row calls bound, or None
        when some piece has no C++ kernel here (then the Python layers run every step)."""
        if model.ops.name != "cpu" or not model.layers:
            return None
        backend = model.layers[0].attn_backend
        if (
            not isinstance(backend, CpuBackend)
            or backend.fallback_reason
            or backend.kv_cache_dtype != "auto"  # quantized K/V are stored by the torch path
        ):
            return None
        layers = []
        for layer in model.layers:
            calls = layer.few_row_calls  # bound only when no product has a bias (few_row_call)
            if calls is None:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            linears = [
                _step_linear(m)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(linear is None for linear in linears):
                return None
            layers.append((calls, linears))
        arch, ext = model.arch, model.ops.impl
        step = ext.DecodeStep(
            backend.extension.api(), arch.num_heads, arch.num_kv_heads, arch.head_dim,
            model.layers[0].scale, model.norm.weight.detach(), model.norm.eps,
        )  # fmt: skip
        for calls, (qkv, o, gate_up, down) in layers:
            step.add_layer(
                calls.norm1_weight.detach(), calls.norm1_eps, qkv, o,
                calls.norm2_weight.detach(), calls.norm2_eps, gate_up, down,
            )  # fmt: skip
        return cls(step, min(calls.max_rows for calls, _ in layers))

    def takes(self, num_tokens: int, meta: object) -> bool:
        """Whether this step's pass can run here: few enough tokens, the C++ kernel's metadata
        (not the torch fallback's), at least one sequence."""
        return (
            0 < num_tokens <= self.max_rows
            and isinstance(meta, CpuAttentionMetadata)
            and meta.seq_lens.numel() > 0
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # the embeddings [T, hidden]; the residual stream, updated in place
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # float32 [max_positions, D/2]
        sin: torch.Tensor,
        kv_caches: list,  # per layer (K, V) head-major, 16-bit
        meta: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """The final normed hidden states [T, hidden], as LlamaForCausalLM.forward returns."""
        return self.step.forward(
            hidden, positions, cos, sin, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        )  # fmt: skip


def _step_linear(linear: torch.nn.Module) -> object | None:
    """The linear's few-row kernel with its weights for the C++ step, or None (no such kernel:
    PrepackedLinear and the quantized linears have one where their few-row call exists)."""
    step_linear = getattr(linear, "step_linear", None)
    return None if step_linear is None else step_linear()
