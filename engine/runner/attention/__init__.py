"""Attention over the paged KV cache: one backend interface, a torch and a Triton backend."""
