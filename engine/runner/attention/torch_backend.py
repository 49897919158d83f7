"""The torch attention backend (CPU, and a reference path anywhere).

Cache layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] (head-major). Row r of
the view [Hkv * num_blocks, block_size * head_dim] is block r % num_blocks of KV head
r // num_blocks, so one index_select of whole blocks yields [Hkv, batch, context, head_dim]:
exactly the batched-matmul operand, with no transpose copy. Whole blocks, not single tokens:
far fewer, larger copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.core.block_manager import cdiv
from engine.runner.attention.base import (
    AttentionBackend,
    AttentionInputs,
    AttentionMetadata,
    pad_block_tables,
)
from engine.runner.attention.kv_quant import LayerKVCache, quantize_fp8, quantize_int8


@dataclass(frozen=True)
class DecodeGroup:
    """Decode requests [start, end) of the step, gathered together."""

    start: int
    end: int
    gather_index: torch.Tensor  # [Hkv * n * nb] cache rows: each request's nb blocks, padded
    ctx_mask: torch.Tensor  # [n, nb * bs] bool: which gathered positions are real context


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """Indices into the head-major cache, built once per step and used by every layer."""

    store_index: torch.Tensor | None = None  # [Hkv * T] rows where the new K/V go
    # Decode requests sorted by context length and split into groups, each padded only to
    # its own longest context (see split_by_length).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Per prefill request, [Hkv * nb] rows of its cached context; None when the whole context
    # is new in this step and stored unquantized (attention then reads the new K/V directly).
    prefill_gather_index: list[torch.Tensor | None] = field(default_factory=list)
    # Scratch for gathered K and V, reused by every layer of the step. (Fresh multi-MB
    # tensors per layer cost more in page faults than the copy itself on CPU.)
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


class TorchBackend(AttentionBackend):
    name = "torch"
    sort_decodes_by_length = True  # split_by_length's groups need sorted context lengths
    kv_cache_dtypes = ("auto", "int8", "fp8")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._workspace: torch.Tensor | None = None  # [2, numel], grow-only

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float):
        kv_cache = LayerKVCache(*kv_cache)
        self.calculate_kv_scales_(k, v, kv_cache, meta)
        return torch_attention(q, k, v, kv_cache, meta, scale)

    def store_fields(self, inputs: AttentionInputs, num_blocks: int) -> dict:
        """The metadata fields of the step's shape and of storing its K/V in this layout
        (head-major), shared with the cpu backend, which stores the same way."""
        return {
            "slot_mapping": inputs.slot_mapping,
            "num_decode_tokens": len(inputs.decode_seq_lens),
            "prefill_q_lens": inputs.prefill_q_lens,
            "prefill_ctx_lens": inputs.prefill_ctx_lens,
            "calculate_kv_scales": inputs.calculate_kv_scales,
            "store_index": store_rows(
                inputs.slot_mapping, self.num_kv_heads, num_blocks * self.block_size
            ),
        }

    def build_metadata(
        self, inputs: AttentionInputs, kv_caches: list[LayerKVCache]
    ) -> TorchAttentionMetadata:
        num_blocks = kv_caches[0][0].shape[1]  # head-major [Hkv, blocks, bs, D]
        meta = TorchAttentionMetadata(**self.store_fields(inputs, num_blocks))
        meta.decode_groups = self._decode_groups(inputs, num_blocks)
        meta.prefill_gather_index = self._prefill_rows(inputs, num_blocks)
        # The largest gather of the step sizes the workspace.
        gathers = [g.gather_index for g in meta.decode_groups] + meta.prefill_gather_index
        most_rows = max((rows.numel() for rows in gathers if rows is not None), default=0)
        if most_rows:
            meta.workspace = self._grow_workspace(most_rows * self.block_size * self.head_dim)
        return meta

    def _decode_groups(self, inputs: AttentionInputs, num_blocks: int) -> list[DecodeGroup]:
        seq_lens, bs, dev = inputs.decode_seq_lens, self.block_size, self.device
        groups = []
        for start, end in split_by_length(seq_lens) if seq_lens else []:
            width = cdiv(seq_lens[end - 1], bs)  # blocks of the group's longest context
            tables = pad_block_tables(inputs.decode_block_tables[start:end], width, dev)
            pos = torch.arange(width * bs, device=dev)
            lens = torch.tensor(seq_lens[start:end], device=dev)
            rows = gather_rows(tables.flatten().long(), self.num_kv_heads, num_blocks)
            groups.append(DecodeGroup(start, end, rows, pos[None, :] < lens[:, None]))
        return groups

    def _prefill_rows(self, inputs: AttentionInputs, num_blocks: int) -> list[torch.Tensor | None]:
        rows: list[torch.Tensor | None] = []
        for table, q_len, ctx_len in zip(
            inputs.prefill_block_tables, inputs.prefill_q_lens, inputs.prefill_ctx_lens,
            strict=True,
        ):  # fmt: skip
            # The whole context is new: attend over the fresh K/V, nothing to gather. Not for a
            # quantized cache: every read sees the stored values there (as in the Triton
            # backend), so a prefix hit, a chunk boundary or a recompute after preemption see
            # the same K/V as the first pass.
            if ctx_len <= q_len and self.kv_cache_dtype == "auto":
                rows.append(None)
                continue
            block_ids = torch.tensor(
                table[: cdiv(ctx_len, self.block_size)], dtype=torch.long, device=self.device
            )
            rows.append(gather_rows(block_ids, self.num_kv_heads, num_blocks))
        return rows

    def _grow_workspace(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for `numel` gathered K and V elements each; at least doubles when it grows."""
        if self._workspace is None or self._workspace.shape[1] < numel:
            old_numel = 0 if self._workspace is None else self._workspace.shape[1]
            self._workspace = torch.empty(
                2, max(numel, 2 * old_numel), dtype=self.dtype, device=self.device
            )
        return self._workspace[0], self._workspace[1]


def store_rows(slots: torch.Tensor, num_kv_heads: int, num_slots: int) -> torch.Tensor:
    """Rows of the [Hkv * num_slots, D] cache view for each (head, new token): [Hkv * T]."""
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None] * num_slots
    return (heads + slots[None, :]).flatten()


# What one more decode group costs per layer (a few extra small ops), in gathered tokens:
# measured ~60 us per group vs ~0.1 us per gathered token on a 2-core CPU; rounded up.
GROUP_OVERHEAD_TOKENS = 1024
MAX_DECODE_GROUPS = 4


def split_by_length(
    lengths: list[int], overhead_tokens: int = GROUP_OVERHEAD_TOKENS,
    max_groups: int = MAX_DECODE_GROUPS,
) -> list[tuple[int, int]]:  # fmt: skip
    """Split sorted context lengths into groups [start, end) to cut padding.

    A group gathers n x (its longest context) tokens. Greedily take the split that saves the
    most padded tokens while it saves more than a group's overhead.
    """
    groups = [(0, len(lengths))]
    while len(groups) < max_groups:
        best_saving, best = 0, None
        for gi, (i, j) in enumerate(groups):
            for k in range(i + 1, j):
                # Rows [i, k) now pad to lengths[k - 1] instead of lengths[j - 1].
                saving = (k - i) * (lengths[j - 1] - lengths[k - 1])
                if saving > best_saving:
                    best_saving, best = saving, (gi, k)
        if best is None or best_saving <= overhead_tokens:
            break
        gi, k = best
        i, j = groups[gi]
        groups[gi : gi + 1] = [(i, k), (k, j)]
    return groups


def gather_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of the [Hkv * num_blocks, bs * D] cache view for each (head, block): [Hkv * n]."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids[None, :]).flatten()


def torch_attention(q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
    kv_cache = LayerKVCache(*kv_cache)
    num_kv_heads, _, _, head_dim = kv_cache.key.shape
    store_kv(kv_cache, k, v, meta.store_index)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        n = group.end - group.start
        k_ctx, v_ctx = _gather(kv_cache, group.gather_index, meta.workspace)
        k_ctx = k_ctx.view(num_kv_heads, n, -1, head_dim)  # [Hkv, n, L, D]
        v_ctx = v_ctx.view(num_kv_heads, n, -1, head_dim)
        out[group.start : group.end] = decode_attention(
            q[group.start : group.end], k_ctx, v_ctx, group.ctx_mask, scale
        )
    start = meta.num_decode_tokens
    for q_len, ctx_len, rows in zip(
        meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_gather_index, strict=True
    ):
        end = start + q_len
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if rows is None:  # whole prompt in this step: the new K/V are the context
            ki = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q, D]
            vi = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # chunk or prefix hit: earlier context comes from the cache
            k_ctx, v_ctx = _gather(kv_cache, rows, meta.workspace)
            ki = k_ctx.view(num_kv_heads, -1, head_dim)[:, :ctx_len].unsqueeze(0)
            vi = v_ctx.view(num_kv_heads, -1, head_dim)[:, :ctx_len].unsqueeze(0)
            # Query i sits at position ctx_len - q_len + i and sees positions <= its own.
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [Hkv, B, L, D]
    v: torch.Tensor,  # [Hkv, B, L, D]
    mask: torch.Tensor,  # [B, L] bool, True = attend
    scale: float,
) -> torch.Tensor:
    """One query per request. float32 goes through SDPA (close to HF's attention, for parity);
    16-bit dtypes use two batched matmuls, measured ~4x faster than CPU SDPA for q_len 1."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, ctx, _ = k.shape
    group = num_heads // num_kv_heads
    if q.dtype == torch.float32:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )  # fmt: skip
        return o.squeeze(2)
    # GQA without copies of K/V: a group's G query heads are the rows of one matrix.
    q_groups = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    q_groups = q_groups.reshape(num_kv_heads * batch, group, head_dim)
    k = k.reshape(num_kv_heads * batch, ctx, head_dim)
    v = v.reshape(num_kv_heads * batch, ctx, head_dim)
    scores = torch.bmm(q_groups, k.transpose(1, 2)).float()  # [Hkv * B, G, L]
    scores = scores.view(num_kv_heads, batch, group, ctx)
    scores.mul_(scale).masked_fill_(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads * batch, group, ctx)
    out = torch.bmm(probs, v).view(num_kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)


def store_kv(
    kv_cache: LayerKVCache,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    store_index: torch.Tensor,  # [Hkv * T] rows of the [Hkv * slots, D] cache view
) -> None:
    """Write the step's K/V (quantized for int8/fp8) and int8's per-token scales."""
    head_dim = kv_cache.key.shape[-1]
    for new, cache, scales in (
        (k, kv_cache.key, kv_cache.key_scale), (v, kv_cache.value, kv_cache.value_scale)
    ):  # fmt: skip
        if cache.dtype == torch.int8:
            new, new_scales = quantize_int8(new)  # [T, Hkv, D], [T, Hkv]
            # Scales are laid out like the cache without head_dim: the same store rows.
            scales.view(-1).index_copy_(0, store_index, new_scales.transpose(0, 1).flatten())
        elif cache.dtype == torch.float8_e4m3fn:
            # index_copy_ has no float8 CPU kernel: move the bytes as uint8.
            new, cache = quantize_fp8(new, scales).view(torch.uint8), cache.view(torch.uint8)
        # [T, Hkv, D] -> [Hkv * T, D] rows, one index_copy per cache.
        cache.view(-1, head_dim).index_copy_(0, store_index, new.transpose(0, 1).flatten(0, 1))


def _gather(
    kv_cache: LayerKVCache,
    rows: torch.Tensor,  # [Hkv * n] rows of the [Hkv * num_blocks, bs * D] view
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy whole blocks into the workspace (dequantized to the workspace's dtype for int8 and
    fp8); returns K and V as [Hkv * n, bs * D]."""
    num_kv_heads, num_blocks, block_size, head_dim = kv_cache.key.shape
    row_numel = block_size * head_dim
    n = rows.numel()
    outs = []
    for cache, scales, ws in zip(
        kv_cache[:2], (kv_cache.key_scale, kv_cache.value_scale), workspace or (None, None),
        strict=True,
    ):  # fmt: skip
        dst = None if ws is None else ws[: n * row_numel].view(n, row_numel)
        if scales is None:
            src = cache.view(num_kv_heads * num_blocks, row_numel)
            outs.append(torch.index_select(src, 0, rows, out=dst))
            continue
        quantized = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
        src = quantized.view(num_kv_heads * num_blocks, row_numel)
        blocks = torch.index_select(src, 0, rows).view(cache.dtype)  # [n, bs * D]
        # Convert into the workspace, then scale in place in its dtype: measured 1.5x faster
        # on CPU than dequantizing in float32 and copying (mixed-dtype ops are not
        # vectorized). In a bfloat16 model the scale is rounded to bfloat16 first (relative
        # error <= 2^-9, bfloat16's own rounding); float32 models dequantize exactly.
        if dst is None:
            dst = torch.empty(n, row_numel, dtype=torch.float32, device=rows.device)
        dst.copy_(blocks)
        if cache.dtype == torch.int8:  # a scale per (head, block, token): the same rows
            token_scales = scales.view(num_kv_heads * num_blocks, block_size)[rows]
            dst.view(n, block_size, head_dim).mul_(token_scales.to(dst.dtype)[:, :, None])
        else:  # fp8: one scale per KV head; rows are grouped head-major, n / Hkv per head
            dst.view(num_kv_heads, -1).mul_(scales.to(dst.dtype)[:, None])
        outs.append(dst)
    return outs[0], outs[1]
