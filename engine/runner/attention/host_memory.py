"""The KV pool's host memory in transparent huge pages (2 MiB) where Linux offers them.

A request's blocks sit anywhere in the pool, so a decode step's attention reads ~2 KB pieces
(one block of one head) scattered over gigabytes: with 4 KiB pages nearly every piece costs a
TLB miss and a page walk. Measured on a 2-core EPYC, one thread, batch 64 x ~400 tokens over a
77 MB pool of scattered blocks: ~4.8 ms per layer with 4 KiB pages, ~4.0 ms with 2 MiB pages.
The kernel picks a page's size when the page is first touched, so the advice comes between
allocation and zeroing. Best effort: elsewhere (not Linux, THP disabled, a GPU tensor) the
pool is the same tensor in ordinary pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20

log = logging.getLogger(__name__)


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                        ) -> torch.Tensor:  # fmt: skip
    """torch.zeros(shape), its CPU memory advised into huge pages before the first touch."""
    data = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(data)
    return data.zero_()


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
        log.info("KV pool stays in 4 KiB pages: madvise(MADV_HUGEPAGE) failed (errno %d)",
                 ctypes.get_errno())  # fmt: skip
        return False
    return True


@functools.cache  # find_library runs ldconfig: once per process, not per pool
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
