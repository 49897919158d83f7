"""Triton kernels for the paged KV cache, each with a shape-checking wrapper.

Every kernel has a plain-torch reference of the same signature in kernels.reference; the tests
run both under TRITON_INTERPRET=1 on CPU. This package imports only torch and triton.
"""

from kernels.kv_store import kv_store
from kernels.paged_attention_decode import paged_attention_decode
from kernels.paged_attention_prefill import paged_attention_prefill
from kernels.reference import (
    kv_store_ref,
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
)

__all__ = [
    "kv_store",
    "kv_store_ref",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "paged_attention_prefill",
    "paged_attention_prefill_ref",
]
