"""Host memory in transparent huge pages (2 MiB) where Linux offers them: the KV pool and the
weights, on CPU (`EngineConfig.huge_pages`; False keeps both in ordinary 4 KiB pages).

The KV pool: a request's blocks sit anywhere in the pool, so a decode step's attention reads
~2 KB pieces (one block of one head) scattered over gigabytes: with 4 KiB pages nearly every
piece costs a TLB miss and a page walk. Measured on a 2-core EPYC, one thread, batch 64 x ~400
tokens over a 77 MB pool of scattered blocks: ~4.8 ms per layer with 4 KiB pages, ~4.0 ms with
2 MiB pages.

The weights: a batch-1 decode step streams every weight once, and each layer's few hundred KB
of int4 weights is a separate allocation in 4 KiB pages, so the stream crosses a page (a TLB
miss, a restart of the hardware prefetcher) every 4 KiB. `place_weights_in_huge_pages` copies
a model's parameters and buffers into one buffer in huge pages: SmolLM2's 120 int4 decoder
products streamed back to back took 2.96-3.04 ms against 3.23-3.35 ms in their own
allocations (2-core EPYC, 2 threads, medians of 600 interleaved pairs, huge pages faster in
530-550 of them; one thread 3.26 vs 3.84 ms).

The kernel picks a page's size when the page is first touched, so the advice comes between
allocation and the first write. Best effort: elsewhere (not Linux, THP disabled, a GPU
tensor) the tensors are the same in ordinary pages. The advice stays with the memory: in one
process, an engine built with huge_pages=False can get back from the allocator memory that an
earlier engine advised, so same-process A/B runs understate the difference, if anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch
from torch import nn

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # each weight starts on a cache line, as torch's own allocations do

log = logging.getLogger(__name__)


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                        ) -> torch.Tensor:  # fmt: skip
    """torch.zeros(shape), its CPU memory advised into huge pages before the first touch."""
    data = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(data)
    return data.zero_()


def plain_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:  # fmt: skip
    """torch.zeros(shape) in ordinary pages: huge_pages=False, the before."""
    return torch.zeros(shape, dtype=dtype, device=device)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside `tensor`'s memory; True when
    the kernel took the advice."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    first = -(-begin // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False  # smaller than one huge page: nothing to gain
    libc = _libc()
    if libc is None:
        return False
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        # EINVAL: a kernel built without THP. Ordinary pages work, a little slower.
        log.info("host memory stays in 4 KiB pages: madvise(MADV_HUGEPAGE) failed (errno %d)",
                 ctypes.get_errno())  # fmt: skip
        return False
    return True


def place_weights_in_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters and buffers into one buffer advised into huge pages, each
    tensor a view of it (same values, dtype, shape and strides; a tied parameter stays one
    tensor). Returns the bytes moved, 0 when nothing moved (no CPU tensors, or the kernel did
    not take the advice: then the tensors stay where they are).

    Call once the weights are final and before anything holds their addresses (the C++ decode
    step and the few-row calls bind them). Skipped: oneDNN's packed weights (prepack.py: an
    opaque layout in oneDNN's own allocation), non-contiguous tensors, and tensors sharing a
    storage with another (moving them apart would break the sharing)."""
    owners: dict[tuple[int, torch.dtype, tuple[int, ...]], list[tuple[dict, str]]] = {}
    by_storage: dict[int, set[tuple[int, torch.dtype, tuple[int, ...]]]] = {}
    tensors: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.layout != torch.strided:
                    continue
                key = (t.data_ptr(), t.dtype, tuple(t.shape))
                owners.setdefault(key, []).append((table, name))
                tensors[key] = t
                by_storage.setdefault(t.untyped_storage().data_ptr(), set()).add(key)
    movable = [
        key
        for keys in by_storage.values()
        if len(keys) == 1
        for key in keys
        if tensors[key].is_contiguous() and tensors[key].numel() > 0
    ]
    offsets, total = {}, 0
    for key in movable:
        offsets[key] = total
        nbytes = tensors[key].numel() * tensors[key].element_size()
        total += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    if total < HUGE_PAGE_BYTES:
        return 0
    # One huge page of slack so the buffer can start on a huge-page boundary.
    raw = torch.empty(total + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    arena = raw[start : start + total]
    if not advise_huge_pages(arena):
        return 0
    for key in movable:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        view = arena[offsets[key] : offsets[key] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        for table, name in owners[key]:
            if isinstance(table[name], nn.Parameter):
                table[name].data = view  # the Parameter object stays: tied modules share it
            else:
                table[name] = view
    return total


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim(0)); True when it
    released any. A load frees much of what it allocated (the 16-bit weights once quantized,
    the copies that moved into huge pages), and glibc keeps freed heap pages mapped: an int4
    SmolLM2 engine stayed resident at 1,757 MB without huge pages and 1,855 MB with them,
    1,611-1,612 MB after the trim (2026-12-06). Elsewhere (not glibc) nothing happens."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    return bool(trim(0)) if trim is not None else False


# mallopt parameters (malloc.h) and the values keep_freed_memory sets.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
KEEP_TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Keep the memory a step frees for the next step's allocations instead of returning it to
    the OS (glibc: allocations up to 32 MiB from the heap, not their own mmap; the heap's free
    top trimmed only past 256 MiB). True when glibc took both settings; elsewhere nothing
    happens. Process-wide and for good: the engine thread's steps are the process's work.

    Why: a sampled (not greedy) batch-64 step allocates several [64, 49152] float32 tensors
    (12.6 MB each: the widened logits, the temperature's quotient, the softmax, the renormalized
    probabilities), and glibc's adaptive thresholds (mmap up to 32 MiB, trim past twice the
    largest chunk freed) handed them back to the OS at one step's end and faulted them in again
    (zeroed by the kernel) in the next, as the heap's history decided: with the embedded model,
    from ~0 to 12,256 page faults (4 KiB) per step in five runs, median steps of 110-156 ms; with
    these settings 0.1-0.6 faults per step and 110-131 ms (40 steps each, 2-core cloud Xeon,
    2026-12-07, the host moving +-10 % between runs). Greedy steps' temporaries are small.
    trim_heap still returns a load's freed pages once, before this."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mmap_ok = mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD_BYTES) == 1
    trim_ok = mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok


@functools.cache  # find_library runs ldconfig: once per process, not per pool
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
