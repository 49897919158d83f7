"""Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM) in plain torch over a paged KV cache.

Tokens of all requests in a step are packed into one flat batch of T tokens; attention finds
each token's request and context through the step's `AttentionMetadata`, built and consumed by
the attention backend the model was made with (see engine/runner/attention/base.py). The small
per-layer ops (RMSNorm with its residual add, RoPE, SiLU-and-mul) go through the model's layer
ops (layer_ops.py): torch, or fused C++ calls on CPU. A layer's four products are its linear
modules, or, at decode's few rows, their C++ kernels called directly (LayerCalls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ANY_ROWS
from engine.runner.attention.base import AttentionBackend, AttentionMetadata
from engine.runner.attention.kv_quant import LayerKVCache
from engine.runner.models.arch import ModelArch, rope_inv_freq
from engine.runner.models.layer_ops import TorchOps

if TYPE_CHECKING:
    from engine.runner.models.decode_step import CpuDecodeStep


class RMSNorm(nn.Module):
    """The weight and epsilon of an RMSNorm; the arithmetic is the model's layer ops'."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class LlamaAttention(nn.Module):
    """q/k/v and output projections of a layer (the math is LlamaDecoderLayer.forward's)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        # q, k and v share one matmul: fewer kernel launches per layer.
        self.qkv_proj = nn.Linear(arch.hidden_size, qkv_out, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=False)


class LlamaMLP(nn.Module):
    """The gated MLP's projections (the math is LlamaDecoderLayer.forward's)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)


Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)  # not frozen: built on every module-path call, 5x cheaper this way
class LayerCalls:
    """What a decoder layer's body calls, read as slots instead of through nn.Module's
    attribute lookup and __call__: at batch 1 a product is 10-40 us of kernel and each Module
    hop ~0.5-1 us, which over SmolLM2's 30 layers was ~1 ms of a 6 ms int4 token (measured,
    2-core EPYC). The products are the linear modules themselves (any number of rows) or, from
    bind_few_row_calls, their few-row kernels with the weights bound."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    norm1_weight: torch.Tensor
    norm1_eps: float
    norm2_weight: torch.Tensor
    norm2_eps: float
    max_rows: int  # the calls apply to steps of at most this many tokens


def few_row_call(linear: nn.Module) -> tuple[Product, int] | None:
    """A linear's few-row kernel with its weights bound and the most rows it takes, or None
    when it has none (torch ops, Triton, a bias): PrepackedLinear's and QuantLinear's."""
    call = getattr(linear, "few_rows", None)
    if call is None or getattr(linear, "bias", None) is not None:
        return None
    return call, linear.few_rows_max


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend, ops: TorchOps) -> None:
        super().__init__()
        self.attn_backend = attn_backend  # shared by all layers; holds no parameters
        self.ops = ops
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)
        self.few_row_calls: LayerCalls | None = None  # bind_few_row_calls

    def module_calls(self) -> LayerCalls:
        """The layer's current modules (any rows); looked up on every call, so a replaced
        linear (quantization, prepacking) is always the one that runs."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        return LayerCalls(
            attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj,
            norm1.weight, norm1.eps, norm2.weight, norm2.eps, max_rows=ANY_ROWS,
        )  # fmt: skip

    def bind_few_row_calls(self) -> None:
        """Bind the few-row kernels of the four products when all have one, for steps with
        at most as many tokens as all of them take (decode at small batch); else unbind.
        Call again after replacing a linear."""
        calls = self.module_calls()
        linears = (calls.qkv, calls.o, calls.gate_up, calls.down)
        few = [few_row_call(linear) for linear in linears]
        if any(f is None for f in few):
            self.few_row_calls = None
            return
        (qkv, a), (o, b), (gate_up, c), (down, d) = few  # type: ignore[misc]
        self.few_row_calls = replace(
            calls, qkv=qkv, o=o, gate_up=gate_up, down=down, max_rows=min(a, b, c, d)
        )

    def forward(
        self,
        hidden: torch.Tensor,  # the previous layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # the residual stream before `hidden` is added; None
        rope_tables: object,  # for layer 0, whose input is the residual stream itself
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        calls, ops = self.few_row_calls, self.ops
        if calls is None or hidden.shape[0] > calls.max_rows:
            calls = self.module_calls()
        if residual is None:
            residual, x = hidden, ops.rms_norm(hidden, calls.norm1_weight, calls.norm1_eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, calls.norm1_weight, calls.norm1_eps)
        # Attention: q, k and v from one product; RoPE on q and k in one go.
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        num_qk_heads, head_dim = num_heads + num_kv_heads, self.head_dim
        qkv = calls.qkv(x)
        qk = ops.rope(qkv, rope_tables, num_qk_heads, head_dim)
        # Slices, not Tensor.split: its Python wrapper was ~5% of a batch-1 step's overhead.
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, num_qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, heads, D]
        # contiguous: a no-op for the backends' outputs, but the C++ products require it.
        attn = calls.o(out.reshape(num_tokens, num_heads * head_dim).contiguous())
        x, residual = ops.add_rms_norm(attn, residual, calls.norm2_weight, calls.norm2_eps)
        return calls.down(ops.silu_mul(calls.gate_up(x))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        max_positions: int,
        attn_backend: AttentionBackend,
        ops: TorchOps | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops or TorchOps()  # engine/runner/models/layer_ops.py
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, attn_backend, self.ops) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.max_positions = max_positions
        self.decode_step: CpuDecodeStep | None = None  # bind_few_row_calls
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the cos/sin tables [max_positions, D/2] in float32 on the model's device.

        Called again after `to_empty()` when the model was built on the meta device.
        """
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inv_freq(self.arch).to(device))
        self.rope_cos = freqs.cos()
        self.rope_sin = freqs.sin()

    def bind_few_row_calls(self) -> None:
        """Every layer's few-row kernels, bound (LlamaDecoderLayer.bind_few_row_calls), and the
        whole pass as one C++ call where every piece has a kernel (decode_step.py): call once
        the weights are final (after quantization and prepacking)."""
        from engine.runner.models.decode_step import CpuDecodeStep

        for layer in self.layers:
            layer.bind_few_row_calls()
        self.decode_step = CpuDecodeStep.build(self)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normed); logits are computed apart."""
        hidden = self.embed_tokens(input_ids)
        step = self.decode_step
        if step is not None and step.takes(hidden.shape[0], meta):
            return step(hidden, positions, self.rope_cos, self.rope_sin, kv_caches, meta)
        rope = self.ops.rope_tables(positions, self.rope_cos, self.rope_sin, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        if residual is None:  # no layers
            return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model dtype (lm_head in the model dtype, as
        HF does). Not widened here: greedy sampling compares them as they are (a float32 copy
        of 64 x 49152 was ~0.4 ms on CPU), and what needs float32 (sampling's softmax,
        penalties, logprobs) widens its own rows. A quantized model has its own lm_head module
        even when the embeddings are tied."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up into our packed layers."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in tensors:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding table is the head
            for parts, fused in _FUSED:
                part = next((p for p in parts if f".{p}." in name), None)
                if part is None:
                    continue
                target = name.replace(f".{part}.", f".{fused}.")
                group = pending.setdefault(target, {})
                group[part] = tensor
                if len(group) == len(parts):
                    _copy_param(params, target, torch.cat([group[p] for p in parts], dim=0))
                    loaded.add(target)
                    del pending[target]
                break
            else:
                _copy_param(params, name, tensor)
                loaded.add(name)
        missing = set(params) - loaded
        if missing or pending:
            raise ValueError(
                f"model: checkpoint lacks tensors {sorted(missing | set(pending))[:5]}"
            )


_FUSED = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


def _copy_param(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(
            f"model: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
