"""The engine's torch attention path against the kernels' torch references."""

from __future__ import annotations

import pytest
import torch

from engine.attention import _decode_attention, _gather_blocks
from kernels.reference import paged_attention_decode_ref


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gathered_decode_attention_matches_reference(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, group, head_dim = 80, 16, 3, 3, 64
    seq_lens = [1, 17, 100, 250]
    batch = len(seq_lens)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    width = -(-max(seq_lens) // block_size)
    perm = torch.randperm(num_blocks, generator=gen)  # shuffled, non-contiguous tables
    tables = perm[: batch * width].view(batch, width).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale)

    k, v = _gather_blocks((k_cache, v_cache), tables.flatten().long(), None)
    k = k.view(batch, -1, num_kv_heads, head_dim)
    v = v.view(batch, -1, num_kv_heads, head_dim)
    pos = torch.arange(width * block_size)
    mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    out = _decode_attention(q, k, v, mask, scale)
    err = (out.float() - expected.float()).norm() / expected.float().norm()
    assert err < tol
