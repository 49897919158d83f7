"""The engine's attention backends against the kernels' torch references (kernel layout): same
cache contents, same outputs; the torch backend's pieces (head-major cache) one by one."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.runner.attention.base import AttentionInputs
from engine.runner.attention.cpu_backend import CpuBackend
from engine.runner.attention.torch_backend import (
    DecodeGroup,
    TorchAttentionMetadata,
    TorchBackend,
    gather_rows,
    split_by_length,
    store_rows,
    torch_attention,
)
from engine.runner.attention.triton_backend import TritonBackend
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 64, 16, 3, 3, 64


def _caches(dtype, gen):
    # The kernels' layout [blocks, bs, Hkv, D] and the same data head-major [Hkv, blocks, bs, D].
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return (k, v), (k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous())


def _tables(seq_lens, gen):
    width = -(-max(seq_lens) // BLOCK_SIZE)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)  # shuffled, non-contiguous tables
    return perm[: len(seq_lens) * width].view(len(seq_lens), width)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_matches_reference(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 17, 100, 250]
    batch = len(seq_lens)
    kernel_cache, head_major = _caches(dtype, gen)
    tables = _tables(seq_lens, gen)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    # The newest token of each request: store it through the engine path.
    new_k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    new_v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.tensor(
        [int(tables[b, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
         for b, n in enumerate(seq_lens)]
    )  # fmt: skip
    for cache, new in zip(kernel_cache, (new_k, new_v), strict=True):
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = new
    expected = paged_attention_decode_ref(q, *kernel_cache, tables.int(), lens, scale)

    pos = torch.arange(tables.shape[1] * BLOCK_SIZE)
    meta = TorchAttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=batch,
        store_index=store_rows(slots, NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE),
    )
    # Two groups (as split_by_length would make for these lengths), each padded to its own max.
    for start, end in [(0, 2), (2, 4)]:
        width = -(-seq_lens[end - 1] // BLOCK_SIZE)
        rows = gather_rows(tables[start:end, :width].flatten(), NUM_KV_HEADS, NUM_BLOCKS)
        mask = pos[None, : width * BLOCK_SIZE] < lens[start:end, None]
        meta.decode_groups.append(DecodeGroup(start, end, rows, mask))
    out = torch_attention(q, new_k, new_v, head_major, meta, scale)
    assert _rel_err(out, expected) < tol
    # The engine's store wrote the same cache contents as the reference layout holds.
    assert torch.equal(head_major[0].permute(1, 2, 0, 3), kernel_cache[0])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_prefill_matches_reference(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [40, 70], [40, 23]  # a whole prompt, and a chunk after 47 cached
    kernel_cache, head_major = _caches(dtype, gen)
    tables = _tables(seq_lens, gen)
    total_q = sum(q_lens)
    q = torch.randn(total_q, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total_q, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total_q, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.cat([
        torch.tensor([int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(n - ql, n)])
        for b, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True))
    ])  # fmt: skip
    for cache, new in zip(kernel_cache, (k, v), strict=True):
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = new
    scale = HEAD_DIM**-0.5
    starts = torch.tensor([0, q_lens[0], total_q], dtype=torch.int32)
    expected = paged_attention_prefill_ref(
        q, *kernel_cache, tables.int(), torch.tensor(seq_lens, dtype=torch.int32), starts, scale
    )
    chunk_rows = gather_rows(tables[1, : -(-70 // BLOCK_SIZE)], NUM_KV_HEADS, NUM_BLOCKS)
    meta = TorchAttentionMetadata(
        slot_mapping=slots, num_decode_tokens=0, prefill_q_lens=q_lens,
        prefill_ctx_lens=seq_lens, prefill_gather_index=[None, chunk_rows],
        store_index=store_rows(slots, NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE),
    )  # fmt: skip
    out = torch_attention(q, k, v, head_major, meta, scale)
    assert _rel_err(out, expected) < tol


def test_split_by_length_cuts_padding_only_when_it_pays():
    assert split_by_length([100] * 10) == [(0, 10)]  # nothing to save
    assert split_by_length([10, 11, 12, 13]) == [(0, 4)]  # too little to save
    lengths = [20] * 30 + [500] * 30  # padding the short ones to 500 wastes 14,400 tokens
    assert split_by_length(lengths) == [(0, 30), (30, 60)]
    many = sorted([16 * (i % 40) + 1 for i in range(64)])
    groups = split_by_length(many, max_groups=4)
    assert len(groups) <= 4 and groups[0][0] == 0 and groups[-1][1] == 64
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))


@pytest.mark.parametrize("backend_cls", [TorchBackend, TritonBackend, CpuBackend])
def test_backends_through_the_interface_match_the_reference(backend_cls):
    """A step as the runner hands it over (decodes first, then a whole prompt and a chunk):
    each backend lays out its own cache, builds its own metadata and matches the reference."""
    gen = torch.Generator().manual_seed(2)
    decode_lens, q_lens, ctx_lens = [9, 40, 120], [12, 20], [12, 53]
    tables = _tables(decode_lens + ctx_lens, gen).tolist()
    backend = backend_cls(NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    layout = backend.kv_cache_shape(NUM_BLOCKS)
    kernel_cache, head_major = _caches(torch.float32, gen)
    kv_cache = kernel_cache if layout == kernel_cache[0].shape else head_major
    assert layout in (kernel_cache[0].shape, head_major[0].shape)
    new_positions = [[n - 1] for n in decode_lens] + [
        list(range(n - q, n)) for n, q in zip(ctx_lens, q_lens, strict=True)
    ]
    slots = torch.tensor([
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for t, ps in zip(tables, new_positions, strict=True) for p in ps
    ])  # fmt: skip
    inputs = AttentionInputs(
        slot_mapping=slots, decode_seq_lens=decode_lens, decode_block_tables=tables[:3],
        prefill_q_lens=q_lens, prefill_ctx_lens=ctx_lens, prefill_block_tables=tables[3:],
    )  # fmt: skip
    total = len(slots)
    q = torch.randn(total, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    meta = backend.build_metadata(inputs, [kv_cache])
    out = backend.forward(q, k, v, kv_cache, meta, HEAD_DIM**-0.5)

    # The reference: store in the kernels' layout, then decode and prefill attention.
    for cache, new in zip(kernel_cache, (k, v), strict=True):
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = new
    width = max(len(t) for t in tables)
    all_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    expected = torch.cat([
        paged_attention_decode_ref(q[:3], *kernel_cache, all_tables[:3],
                                   torch.tensor(decode_lens, dtype=torch.int32), HEAD_DIM**-0.5),
        paged_attention_prefill_ref(q[3:], *kernel_cache, all_tables[3:],
                                    torch.tensor(ctx_lens, dtype=torch.int32),
                                    torch.tensor([0, 12, 32], dtype=torch.int32), HEAD_DIM**-0.5),
    ])  # fmt: skip
    assert _rel_err(out, expected) < 1e-5
    if kv_cache is head_major:
        assert torch.equal(head_major[0].permute(1, 2, 0, 3), kernel_cache[0])
